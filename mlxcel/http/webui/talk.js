// Talk mode: the microphone streamed to /v1/realtime (OpenAI Realtime events, PCM16 at 24 kHz
// both ways), the answer's audio played as it arrives, the live transcript and answer text.
// Turn-taking is the server's VAD: when it hears speech over an answer it cancels that answer,
// and the page drops the audio it still had queued. #talk[data-played-bytes] counts the answer
// audio scheduled for playback, #talk[data-cut-off] the answers cut off while they played,
// #talk[data-mic-rate] the rate the microphone is read at (resampled to RATE for the server);
// #talk[data-state] is off, connecting, listening, or answering.

const RATE = 24000;

const talk = {
  on: false, // from the button's press until the talk ends
  ws: null,
  context: null,
  stream: null,
  playhead: 0,
  sources: new Set(),
  lines: new Map(), // item or response id -> its line in the log
};

function talkState(state, text) {
  $("talk").dataset.state = state;
  $("talk-state").textContent = text;
}

function talkLine(id, role) {
  let line = talk.lines.get(id);
  if (!line) {
    line = el("p", `line ${role}`);
    line.dataset.id = id;
    talk.lines.set(id, line);
    $("talk-log").append(line);
  }
  return line;
}

function realtimeURL() {
  const url = new URL(`${API}/v1/realtime`, location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.searchParams.set("protocol", "openai");
  return url.href;
}

function base64Of(buffer) {
  const bytes = new Uint8Array(buffer);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function play(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  if (!pcm.length) return;
  const buffer = talk.context.createBuffer(1, pcm.length, RATE);
  const channel = buffer.getChannelData(0);
  for (let i = 0; i < pcm.length; i++) channel[i] = pcm[i] / 0x8000;
  const source = talk.context.createBufferSource();
  source.buffer = buffer;
  source.connect(talk.context.destination);
  // Back to back after what is already queued, so chunks play as one stream.
  talk.playhead = Math.max(talk.playhead, talk.context.currentTime + 0.05);
  source.start(talk.playhead);
  talk.playhead += buffer.duration;
  talk.sources.add(source);
  source.onended = () => talk.sources.delete(source);
  const panel = $("talk");
  panel.dataset.playedBytes = Number(panel.dataset.playedBytes) + bytes.length;
}

function silencePlayback() {
  if (talk.sources.size) {
    const panel = $("talk");
    panel.dataset.cutOff = Number(panel.dataset.cutOff || 0) + 1;
  }
  for (const source of talk.sources) source.stop();
  talk.sources.clear();
  talk.playhead = 0;
}

function onRealtimeEvent(event) {
  switch (event.type) {
    case "session.created": {
      const settings = loadSettings();
      const sampling = samplingFields(settings);
      const limit = sampling.max_tokens;
      const session = {
        type: "realtime",
        instructions: settings.system || "You are a helpful voice assistant. Answer briefly.",
        output_modalities: ["audio"],
        max_output_tokens: limit >= 1 && limit <= 4096 ? Math.round(limit) : "inf",
        audio: { input: { turn_detection: { type: "server_vad" } } },
      };
      // The page's temperature holds in talk mode too (the session takes 0 to 2).
      const t = sampling.temperature;
      if (t !== undefined && t >= 0 && t <= 2) session.temperature = t;
      talk.ws.send(JSON.stringify({ type: "session.update", session }));
      break;
    }
    case "session.updated":
      talkState("listening", "Listening\u2026 speak now.");
      break;
    case "input_audio_buffer.speech_started":
      // Barge-in: whatever the answer still had to say is not wanted any more.
      silencePlayback();
      talkState("listening", "Hearing you\u2026");
      break;
    case "conversation.item.input_audio_transcription.delta":
      talkLine(event.item_id, "user").textContent += event.delta;
      break;
    case "conversation.item.input_audio_transcription.completed":
      talkLine(event.item_id, "user").textContent = event.transcript;
      break;
    case "response.created":
      talkLine(event.response.id, "assistant");
      talkState("answering", "Answering\u2026");
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      talkLine(event.response_id, "assistant").textContent += event.delta;
      break;
    case "response.output_audio.delta":
      play(event.delta);
      break;
    case "response.done":
      if (event.response.status === "cancelled") {
        talkLine(event.response.id, "assistant").classList.add("cancelled");
        silencePlayback();
      }
      talkState("listening", "Listening\u2026");
      break;
    case "error":
      talkState($("talk").dataset.state, `Error: ${event.error?.message || "unknown"}`);
      break;
  }
  $("talk").scrollTop = $("talk").scrollHeight;
}

async function startTalk() {
  if (talk.on) return;
  talk.on = true;
  $("messages").hidden = true;
  $("talk").hidden = false;
  $("talk-button").classList.add("on");
  $("talk-log").replaceChildren();
  talk.lines.clear();
  talkState("connecting", "Connecting\u2026");
  try {
    talk.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    // At the device's own rate: the worklet resamples the microphone, and buffers at RATE
    // are resampled by the browser when they play.
    talk.context = new AudioContext();
    $("talk").dataset.micRate = talk.context.sampleRate;
    const source = $("mic-worklet").textContent;
    const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
    await talk.context.audioWorklet.addModule(url);
    URL.revokeObjectURL(url);
  } catch (error) {
    talkState("off", `No microphone: ${error.message}`);
    stopTalk(false);
    return;
  }
  if (!talk.on) {
    stopTalk(false); // ended while the browser asked for the microphone: release it
    return;
  }
  const key = apiKey();
  // A browser's WebSocket cannot send headers: the key travels as a subprotocol.
  const ws = new WebSocket(realtimeURL(), key ? ["realtime", `openai-insecure-api-key.${key}`] : []);
  talk.ws = ws;
  ws.onmessage = (message) => onRealtimeEvent(JSON.parse(message.data));
  let opened = false;
  ws.onclose = (close) => {
    if (talk.ws === ws) {
      stopTalk(false);
      const why = !opened
        ? "The server refused the voice session."
        : close.code === 1000
          ? "Talk ended."
          : `Disconnected (${close.code}${close.reason ? `: ${close.reason}` : ""}).`;
      talkState("off", why);
    }
  };
  ws.onopen = () => {
    opened = true;
    const mic = talk.context.createMediaStreamSource(talk.stream);
    const node = new AudioWorkletNode(talk.context, "mic-capture", { processorOptions: { rate: RATE } });
    node.port.onmessage = (frame) => {
      if (ws.readyState === WebSocket.OPEN) {
        ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: base64Of(frame.data) }));
      }
    };
    // Pulled by the graph only when connected to its output; a muted gain keeps the
    // microphone out of the speakers.
    const mute = talk.context.createGain();
    mute.gain.value = 0;
    mic.connect(node).connect(mute).connect(talk.context.destination);
  };
}

function stopTalk(showChat = true) {
  talk.on = false;
  const ws = talk.ws;
  talk.ws = null;
  if (ws && ws.readyState <= WebSocket.OPEN) ws.close(1000, "talk ended");
  silencePlayback();
  talk.stream?.getTracks().forEach((track) => track.stop());
  talk.stream = null;
  talk.context?.close();
  talk.context = null;
  $("talk-button").classList.remove("on");
  keepTalkTurns();
  if (showChat) {
    talkState("off", "");
    $("talk").hidden = true;
    $("messages").hidden = false;
  }
}

// What was said joins the current conversation, so talking and typing continue each other.
function keepTalkTurns() {
  const said = [...talk.lines.values()].filter((line) => line.textContent.trim());
  talk.lines.clear();
  if (!said.length) return;
  for (const line of said) {
    const role = line.classList.contains("user") ? "user" : "assistant";
    const message = { role, content: line.textContent.trim() };
    if (line.classList.contains("cancelled")) message.stats = { stopped: true };
    chat.current.messages.push(message);
  }
  if (chat.current.title === "New chat") chat.current.title = said[0].textContent.trim().slice(0, 60);
  persist();
  renderMessages();
}
