// Runs on the audio thread: the microphone, at the AudioContext's rate (the device's: some
// browsers refuse a microphone in a context at another rate), resampled to the server's rate
// and posted to the page as 80 ms frames of PCM16.

class MicCapture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const rate = options.processorOptions.rate;
    this.step = sampleRate / rate; // input samples per output sample
    this.frame = new Int16Array(Math.round(rate * 0.08));
    this.filled = 0;
    // Where the next output sample falls, in input samples from this block's start; in
    // [-1, 0) it lies between the previous block's last sample and this block's first.
    this.position = 0;
    this.previous = 0;
  }

  push(value) {
    const s = Math.max(-1, Math.min(1, value));
    this.frame[this.filled++] = s < 0 ? s * 0x8000 : s * 0x7fff;
    if (this.filled === this.frame.length) {
      const full = this.frame;
      this.frame = new Int16Array(full.length);
      this.filled = 0;
      this.port.postMessage(full.buffer, [full.buffer]);
    }
  }

  process(inputs) {
    const samples = inputs[0] && inputs[0][0];
    if (!samples || !samples.length) return true;
    // Linear interpolation: enough for speech, which carries little above 8 kHz.
    let p = this.position;
    while (p + 1 < samples.length) {
      const i = Math.floor(p);
      const a = i < 0 ? this.previous : samples[i];
      this.push(a + (samples[i + 1] - a) * (p - i));
      p += this.step;
    }
    this.previous = samples[samples.length - 1];
    this.position = p - samples.length;
    return true;
  }
}

registerProcessor("mic-capture", MicCapture);
