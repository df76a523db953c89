"""A minimal realtime voice client for mlxcel's /v1/realtime (VoiceChat vocabulary).

    python examples/realtime_client.py question.wav [--url ws://127.0.0.1:8080] [--api-key K]
        [--out answer.wav]

Reads a WAV file (any rate, mono or stereo, 16-bit), streams it to the server as 16 kHz PCM16 in
80 ms frames at real-time pace, commits the turn, prints what the server heard and answered,
and writes the spoken answer (22.05 kHz) to --out. Needs only `trio-websocket` and numpy.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import wave

import numpy as np
import trio
import trio_websocket

FRAME = 1280  # samples: 80 ms at 16 kHz


def read_wav_16k(path: str) -> np.ndarray:
    with wave.open(path, "rb") as w:
        if w.getsampwidth() != 2:
            raise SystemExit("need a 16-bit PCM WAV file")
        rate, channels = w.getframerate(), w.getnchannels()
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, channels)
    mono = pcm.mean(axis=1)
    # Linear interpolation is enough for speech recognition.
    n = int(len(mono) * 16_000 / rate)
    return np.interp(np.linspace(0, len(mono) - 1, n), np.arange(len(mono)), mono).astype("<i2")


async def talk(url: str, api_key: str | None, audio: np.ndarray, out: str | None) -> None:
    headers = [(b"Authorization", f"Bearer {api_key}".encode())] if api_key else []
    async with trio_websocket.open_websocket_url(url + "/v1/realtime", extra_headers=headers) as ws:

        async def send(event: dict[str, object]) -> None:
            await ws.send_message(json.dumps(event))

        created = json.loads(await ws.get_message())
        print("session", created["session"]["id"])
        await send({"type": "session.update", "session": {"system_prompt": "Answer briefly."}})
        updated = json.loads(await ws.get_message())
        rate = updated["session"]["output_audio_format"]["sample_rate"]
        for start in range(0, len(audio), FRAME):
            chunk = audio[start : start + FRAME].tobytes()
            await send(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
            )
            await trio.sleep(0.08)  # a microphone delivers audio in real time
        await send({"type": "input_audio_buffer.commit"})
        answer = bytearray()
        while True:
            try:
                event = json.loads(await ws.get_message())
            except trio_websocket.ConnectionClosed:
                break  # the one-turn session ends with close 1000
            kind = event["type"]
            if kind == "conversation.item.input_audio_transcription.completed":
                print("you said:", event["transcript"])
            elif kind == "response.text.delta":
                print(event["delta"], end="", flush=True)
            elif kind == "response.audio.delta":
                answer += base64.b64decode(event["delta"])
            elif kind == "response.done":
                print()
            elif kind == "error":
                print("error:", event["error"], file=sys.stderr)
        print(f"answer audio: {len(answer) / 2 / rate:.1f} s at {rate} Hz")
        if out:
            with wave.open(out, "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(rate)
                w.writeframes(bytes(answer))


def main() -> None:
    p = argparse.ArgumentParser(description="Talk to mlxcel's realtime voice WebSocket")
    p.add_argument("wav")
    p.add_argument("--url", default="ws://127.0.0.1:8080")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=None, help="write the spoken answer to this WAV file")
    args = p.parse_args()
    trio.run(talk, args.url, args.api_key, read_wav_16k(args.wav), args.out)


if __name__ == "__main__":
    main()
