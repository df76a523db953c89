"""Image requests beside text streams (issue 24): does reading an image stall the batch?

8 text streams decode without pause (each asks for a long answer, then asks again); for
``--seconds`` they run alone, then for as long again while one image request arrives every
second. Printed: the text streams' inter-token gap p50 and p90 in each spell and their ratio
(target: p50 with images <= 1.5x without), and the image requests' time to first token.

    .venv/bin/python tools/bench/vision.py [--family idefics3|qwen2_vl] [--model DIR]
        [--seconds 20] [--streams 8]

Without ``--model`` it builds a tiny random-weight checkpoint of ``--family`` (the tests'
builder): the figures then measure the serving path (prefill of the image prompt as one step
of the batch, the vision cache off), not a real vision tower's cost.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def image_uri(seed: int, size: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def text_stream(base: str, stop: threading.Event, gaps: list[tuple[float, float]]) -> None:
    """Ask again and again; record (time, gap since the previous content chunk)."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            last = None
            with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if stop.is_set():
                        break
                    if not line.startswith("data: {") or '"content":"' not in line:
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append((now, now - last))
                    last = now


def image_request(base: str, seed: int, size: int) -> float:
    content = [
        {"type": "image_url", "image_url": {"url": image_uri(seed, size)}},
        {"type": "text", "text": "Describe the image."},
    ]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "stream": True}
    tic = time.monotonic()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if '"content":"' in line:
                return time.monotonic() - tic
    return float("nan")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="idefics3", choices=["idefics3", "qwen2_vl"])
    ap.add_argument("--model", help="a VLM folder (default: a tiny random one of --family)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--size", type=int, default=512, help="image side in pixels")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from tests.support.tiny_vlm import build_tiny_vlm

        model = str(build_tiny_vlm(Path(tempfile.mkdtemp()) / args.family, args.family))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"mlxcel-bench-vision-{port}.log"
    argv = [sys.executable, "-m", "mlxcel", "serve", "-m", model, "--port", str(port)]
    argv += ["-np", str(args.streams + 4), "--vision-cache-size", "0"]
    with log.open("wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the server did not start: see {log}")
            time.sleep(0.3)
        image_request(base, 0, args.size)  # warm the vision path
        gaps: list[tuple[float, float]] = []
        stop = threading.Event()
        readers = [
            threading.Thread(target=text_stream, args=(base, stop, gaps), daemon=True)
            for _ in range(args.streams)
        ]
        for t in readers:
            t.start()
        time.sleep(3)  # every stream decoding
        alone_from = time.monotonic()
        time.sleep(args.seconds)
        images_from = time.monotonic()
        ttfts = []
        seed = 1
        while time.monotonic() < images_from + args.seconds:
            tic = time.monotonic()
            ttfts.append(image_request(base, seed, args.size))
            seed += 1
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tic)))
        images_to = time.monotonic()
        stop.set()
        alone = [g for t, g in gaps if alone_from <= t < images_from]
        beside = [g for t, g in gaps if images_from <= t < images_to]
        a50, b50 = statistics.median(alone), statistics.median(beside)
        print(f"model: {model}; {args.streams} text streams; images {args.size}x{args.size} px")
        print("| spell | text gap p50 ms | text gap p90 ms | gaps |")
        print("|---|---:|---:|---:|")
        print(f"| alone | {a50 * 1000:.1f} | {pct(alone, 0.9) * 1000:.1f} | {len(alone)} |")
        b90 = pct(beside, 0.9) * 1000
        print(f"| one image a second | {b50 * 1000:.1f} | {b90:.1f} | {len(beside)} |")
        print(
            f"gap p50 with images / alone: {b50 / a50:.2f}x (target <= 1.5x); "
            f"image TTFT p50 {statistics.median(ttfts):.2f} s, p90 {pct(ttfts, 0.9):.2f} s "
            f"({len(ttfts)} images)"
        )
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
