"""Realtime voice under load: N sessions, each speaking a ~2 s question every P seconds at
real-time pace (80 ms frames, silence in between, server VAD ends each turn), not a test.

    .venv/bin/python tools/bench/realtime.py                 # 8 sessions, 5 minutes
    .venv/bin/python tools/bench/realtime.py --duration 120 --sessions 8
    .venv/bin/python tools/bench/realtime.py --duration 120 --server-arg=--no-spec-ngram

Reports the time from the end of speech to the first ``response.audio.delta``, measured two
ways: from the last spoken sample the client sent (what a user waits, including the VAD's
silence window) and from the ``speech_stopped`` event (the turn's end as the server saw it).
"Behind real time": the client paces frames on an absolute schedule; a session falls behind
when its sends lag that schedule (backpressure) or when the server's ``speech_stopped`` comes
later and later after the audio that ended the turn (the server cannot keep up with the
incoming audio). On the way out, each answer is played as a client would (from its first
audio delta, in real time): audio that arrives after its turn to play is a gap the user hears,
reported per answer.

Peer, measured in the same run on the same server while idle: the same cascade a client
would do without the WebSocket, over HTTP, one question at a time -- transcription, a
streamed chat completion up to its first sentence, then /v1/audio/speech up to its first
audio byte. Ratio = realtime median / that peer median.

Floor, also measured idle in the same run: what the machine allows at best. The model step
with one row per session decoding, times the tokens of each answer's first spoken piece (cut
as the server cuts it), plus the speech model's first audio for a 5-word piece. It leaves out
transcription, the joining turn's prompt pass and every other session's CPU: a lower bound.

Past capacity (issue 39): ``--clients N`` opens N sessions at the same moment against a server
whose session cap is ``--sessions`` (the server it starts derives that cap from ``--parallel``
and ``--audio-queue-depth``; with ``--url`` the cap is read from ``/props``). The ones past the
cap must be refused at open (``server_busy``, close 1013); every admitted session speaks as
above, and each of its turns must be answered with audio, with no ``error`` event and no
close 1011. The summary says which held; with ``--clients`` the exit status is 1 when any
did not.

    .venv/bin/python tools/bench/realtime.py --sessions 4 --clients 6 --duration 45
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
import trio
import trio_websocket

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mlxcel.actors.realtime.sentences import SentenceSplitter  # noqa: E402 - after sys.path
from tests.support.launch import serve  # noqa: E402 - after sys.path
from tests.support.realtime import connect, frames, silence, spoken  # noqa: E402 - after sys.path

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Tell me a fact about the moon.",
    "Why is the sky blue?",
]
FRAME_S = 0.08
OUTPUT_RATE = 22_050  # the VoiceChat protocol's default output rate


# The server's own default (--audio-queue-depth): the bench raises it only past it.
DEFAULT_AUDIO_QUEUE_DEPTH = 8


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    # No --realtime-max-sessions: the server derives its cap, min(--parallel,
    # --audio-queue-depth), so --sessions rows and places make a cap of --sessions.
    depth = max(args.sessions, DEFAULT_AUDIO_QUEUE_DEPTH)
    flags = ["--parallel", str(args.sessions), "--audio-queue-depth", str(depth)]
    if args.model:
        flags += ["-m", args.model]
    flags += args.server_arg
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"mlxcel-bench-realtime-{args.port}.log"
    return serve(flags, args.port, log)


def wav_bytes(pcm: np.ndarray, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


def peer_once(base: str, pcm: np.ndarray, max_tokens: int) -> float:
    """Seconds from 'end of speech' to the first audio byte through the plain HTTP routes."""
    with httpx.Client(base_url=base, timeout=300) as http:
        t0 = time.perf_counter()
        text = http.post(
            "/v1/audio/transcriptions",
            files={"file": ("q.wav", wav_bytes(pcm), "audio/wav")},
            data={"model": "whisper-1"},
        ).json()["text"]
        sentence = ""
        body = {
            "model": "default",
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": text},
            ],
        }
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                sentence += delta
                if any(p in delta for p in ".!?") and len(sentence) > 8:
                    break
        with http.stream(
            "POST",
            "/v1/audio/speech",
            json={
                "model": "tts-1",
                "input": sentence or "Okay.",
                "voice": "alloy",
                "response_format": "pcm",
            },
        ) as r:
            for chunk in r.iter_bytes():
                if chunk:
                    return time.perf_counter() - t0
    return float("nan")


# The floor: what the machine allows at best, measured on the idle server before the run.
# A typical first piece (the server speaks an answer's first five words, or its first clause,
# as soon as they are generated), and a context as long as a voice session's prompt.
FIRST_PIECE = "The answer to this question"
FLOOR_CONTEXT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 22)


async def _token_times(http: httpx.AsyncClient, prompt: str, tokens: int) -> list[float]:
    body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "stream": True}
    times = []
    async with http.stream("POST", "/completion", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and not json.loads(line[6:]).get("stop"):
                times.append(time.perf_counter())
    return times


async def decode_step(base: str, rows: int, tokens: int = 24) -> float:
    """Median seconds per model step with ``rows`` requests decoding together (each streams a
    token a step): the pace of every answer's first words when that many sessions answer."""
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:

        async def one(i: int) -> None:
            t = await _token_times(http, f"{i}. {FLOOR_CONTEXT}", tokens)
            # From the 8th token on, every row has joined: steady batch steps.
            gaps.extend(b - a for a, b in zip(t[8:], t[9:], strict=False))

        async with trio.open_nursery() as n:
            for i in range(rows):
                n.start_soon(one, i)
    return median(gaps)


def first_piece_audio(base: str, runs: int = 3) -> float:
    """Seconds to the first audio byte of a typical first piece, idle."""
    out = []
    with httpx.Client(base_url=base, timeout=300) as http:
        for i in range(runs + 1):
            t0 = time.perf_counter()
            body = {"model": "tts-1", "input": FIRST_PIECE, "response_format": "pcm"}
            with http.stream("POST", "/v1/audio/speech", json=body) as r:
                for chunk in r.iter_bytes():
                    if chunk:
                        break
            if i:  # the first run warms up
                out.append(time.perf_counter() - t0)
    return median(out)


def first_piece_tokens(base: str, answers: list[str]) -> list[int]:
    """Tokens in each answer's first spoken piece, cut as the server cuts it: the text fed a
    word at a time, as it streams (fed whole, the splitter finds the first sentence's end
    before it looks for the early cut after a few words, and the piece comes out longer)."""
    import re

    counts = []
    with httpx.Client(base_url=base, timeout=60) as http:
        for text in answers:
            split = SentenceSplitter()
            pieces: list[str] = []
            for word in re.finditer(r"\S+\s*", text + " "):
                pieces += split.feed(word.group())
                if pieces:
                    break
            piece = pieces[0] if pieces else split.flush()
            if piece:
                counts.append(len(http.post("/tokenize", json={"content": piece}).json()["tokens"]))
    return counts


@attrs.define
class Floor:
    step: float  # seconds per model step with one row per session decoding
    speech: float  # seconds to the first audio of a first piece
    piece_tokens: list[int] = attrs.Factory(list)


class Crowd:
    """All clients open at the same moment; once each is admitted or refused, the admitted
    ones start speaking, spread over the period in the order they were admitted."""

    def __init__(self, clients: int) -> None:
        self.clients = clients
        self.answered = 0  # clients told admitted or refused so far
        self.admitted: list[Session] = []
        self.all_in = trio.Event()
        self.start = 0.0

    def arrived(self, session: Session | None) -> None:
        if session is not None:
            self.admitted.append(session)
        self.answered += 1
        if self.answered == self.clients:
            self.start = trio.current_time() + 0.5
            self.all_in.set()

    def start_at(self, session: Session, period: float) -> float:
        return self.start + self.admitted.index(session) * period / len(self.admitted)


class Session:
    def __init__(self, index: int) -> None:
        self.index = index
        # Refused at open: the error event's code and the close code; None when admitted.
        self.refused: tuple[str, int | None] | None = None
        # The server closed an admitted session before the client was done (1011: it failed).
        self.server_close: int | None = None
        self.question = spoken(QUESTIONS[index % len(QUESTIONS)])
        self.spoken_end: list[float] = []  # when the last speech frame of each turn was sent
        self.stop_due: list[float] = []  # when the turn's trailing silence (VAD window) ended
        self.stopped_at: list[float] = []
        # Per turn (speech_stopped), its answer's first audio; None when none came (the next
        # question cancelled the answer first, or the run ended).
        self.first_audio: list[float | None] = []
        self.send_lag: list[float] = []
        self.errors: list[str] = []
        self.error_messages: list[str] = []
        self._awaiting_audio = False
        # Stage times of answered turns: stop -> transcript -> first text -> first audio.
        self.stages: list[tuple[float, float, float]] = []
        self._marks: dict[str, float] = {}
        # Playback as a client would do it: an answer plays from its first audio delta on, in
        # real time; a delta that arrives after its turn to play stalls playback (a gap heard).
        self.stalls: list[float] = []  # seconds of gap per answer that sent audio
        self._play_at: float | None = None  # when the next delta's audio is due to play
        self._stall = 0.0
        # Each answer's text (for the floor: how many tokens its first spoken piece took).
        self.answers: list[str] = []
        self._text = ""

    async def run(self, base: str, args: argparse.Namespace, crowd: Crowd, open_at: float) -> None:
        await trio.sleep_until(open_at)
        counted = False
        try:
            async with connect(base) as c:
                first = await c.recv(timeout=120)
                if first["type"] == "error":
                    code = first["error"].get("code", "?")
                    crowd.arrived(None)
                    counted = True
                    self.refused = (code, await c.closed())
                    return
                crowd.arrived(self)
                counted = True
                await crowd.all_in.wait()
                await trio.sleep_until(crowd.start_at(self, args.period))
                await self._talk(c, args)
        except* trio_websocket.ConnectionClosed as group:
            # The server ended the session: the close code tells why (1011: it failed).
            first_closed = group.exceptions[0]
            assert isinstance(first_closed, trio_websocket.ConnectionClosed)
            reason = first_closed.reason
            self.server_close = reason.code if reason is not None else 1006  # no close frame
        finally:
            if not counted:  # closed before its first event: neither admitted nor refused
                crowd.arrived(None)

    async def _talk(self, c: Any, args: argparse.Namespace) -> None:
        await c.send(
            {
                "type": "session.update",
                "session": {
                    "system_prompt": "Answer briefly.",
                    "max_response_output_tokens": args.max_tokens,
                    "turn_detection": {
                        "type": "server_vad",
                        "silence_duration_ms": args.silence_ms,
                    },
                    "max_streaming_seconds": 600,
                    **(
                        {}
                        if args.truncation_tokens is None
                        else {
                            "truncation": {
                                "type": "retention_ratio",
                                "retention_ratio": args.retention_ratio,
                                "token_limits": {"post_instructions": args.truncation_tokens},
                            }
                        }
                    ),
                },
            }
        )
        async with trio.open_nursery() as n:
            n.start_soon(self._receive, c)
            await self._send(c, args)
            # Let the last answers arrive (keep the session alive with silence meanwhile).
            quiet = frames(silence(FRAME_S))[0]
            with trio.move_on_after(120):
                while self._awaiting_audio or len(self.stopped_at) < len(self.spoken_end):
                    await c.send({"type": "input_audio_buffer.append", "audio": quiet})
                    await trio.sleep(FRAME_S)
            n.cancel_scope.cancel()

    async def _send(self, c: Any, args: argparse.Namespace) -> None:
        period_frames = int(args.period / FRAME_S)
        q_frames = frames(self.question)
        quiet = frames(silence(FRAME_S))[0]
        t0 = trio.current_time()
        end = t0 + args.duration
        k = 0
        while True:
            due = t0 + k * FRAME_S
            if due >= end:
                return
            await trio.sleep_until(due)
            self.send_lag.append(trio.current_time() - due)
            pos = k % period_frames
            frame = q_frames[pos] if pos < len(q_frames) else quiet
            await c.send({"type": "input_audio_buffer.append", "audio": frame})
            if pos == len(q_frames) - 1:
                now = trio.current_time()
                self.spoken_end.append(now)
                self.stop_due.append(now + args.silence_ms / 1000)
            k += 1

    async def _receive(self, c: Any) -> None:
        while True:
            event = await c.recv(timeout=3600)
            kind = event["type"]
            now = trio.current_time()
            if kind == "input_audio_buffer.speech_stopped":
                self.stopped_at.append(now)
                self.first_audio.append(None)
                self._awaiting_audio = True
                self._marks = {"stop": now}
            elif kind == "conversation.item.input_audio_transcription.completed":
                self._marks.setdefault("transcript", now)
            elif kind == "response.text.delta":
                self._marks.setdefault("text", now)
                self._text += event.get("delta", "")
            if kind == "response.audio.delta":
                seconds = len(event["delta"]) * 3 / 4 / 2 / OUTPUT_RATE
                if self._play_at is None:
                    self._play_at, self._stall = now, 0.0
                elif now > self._play_at:
                    self._stall += now - self._play_at
                    self._play_at = now
                self._play_at += seconds
            elif kind in ("response.done", "response.cancelled"):
                if self._text:
                    self.answers.append(self._text)
                    self._text = ""
                if self._play_at is not None:
                    self.stalls.append(self._stall)
                    self._play_at = None
            if kind == "response.audio.delta" and self._awaiting_audio:
                self.first_audio[-1] = now
                self._awaiting_audio = False
                m = self._marks
                if {"stop", "transcript", "text"} <= m.keys():
                    self.stages.append(
                        (m["transcript"] - m["stop"], m["text"] - m["transcript"], now - m["text"])
                    )
            elif kind == "error":
                error = event["error"]
                self.errors.append(error.get("code", "?"))
                self.error_messages.append(f"{error.get('code', '?')}: {error.get('message')}")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def run_sessions(base: str, args: argparse.Namespace) -> list[Session]:
    sessions = [Session(i) for i in range(args.clients)]
    crowd = Crowd(len(sessions))
    open_at = trio.current_time() + 1
    async with trio.open_nursery() as n:
        for s in sessions:
            # All open at once; the admitted ones then spread their questions over the
            # period, as independent users would.
            n.start_soon(s.run, base, args, crowd, open_at)
    return sessions


def thirds(timed: list[tuple[float, Any]]) -> tuple[list[Any], list[Any]]:
    """The values of the first and of the last third of ``(time, value)`` pairs, by time."""
    values = [v for _, v in sorted(timed, key=lambda tv: tv[0])]
    third = max(1, len(values) // 3)
    return values[:third], values[-third:]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def session_cap(base: str) -> dict[str, Any] | None:
    """The server's realtime session cap and capacity (``/props`` ``capabilities.realtime``)."""
    caps = httpx.get(f"{base}/props", timeout=60).json().get("capabilities", {})
    cap: dict[str, Any] | None = caps.get("realtime")
    return cap


def past_capacity(sessions: list[Session], cap: dict[str, Any] | None) -> bool:
    """Print what happened to the clients against the cap; True when it is what issue 39
    asks: the ones past the cap refused at open (server_busy, close 1013), every admitted
    session's turns answered with audio, no error event, no session ended by the server."""
    admitted = [s for s in sessions if s.refused is None and s.server_close is None]
    ended = [s for s in sessions if s.refused is None and s.server_close is not None]
    refused = [s for s in sessions if s.refused is not None]
    limit = cap["max_sessions"] if cap is not None else None
    if cap is None:
        print("cap: unknown (no realtime entry in /props)")
    else:
        source = cap["capacity_from"]
        print(
            f"clients {len(sessions)} opened at once against a cap of {limit} (capacity "
            f"{cap['capacity']}: min(--parallel {source['parallel']}, --audio-queue-depth "
            f"{source['audio_queue_depth']}))"
        )
    busy = [s for s in refused if s.refused == ("server_busy", 1013)]
    other = [s.refused for s in refused if s.refused != ("server_busy", 1013)]
    print(
        f"  refused at open: {len(refused)} (server_busy + close 1013: {len(busy)}"
        + (f"; otherwise: {other}" if other else "")
        + ")"
    )
    asked = sum(len(s.spoken_end) for s in admitted + ended)
    heard = sum(1 for s in admitted + ended for a in s.first_audio if a is not None)
    errors = [m for s in admitted + ended for m in s.error_messages]
    closes = [s.server_close for s in ended]
    print(
        f"  admitted: {len(admitted) + len(ended)}; turns asked {asked}, answered with audio "
        f"{heard}; error events: {len(errors)}; closes 1011: {closes.count(1011)}; other "
        f"server closes: {[c for c in closes if c != 1011] or 'none'}"
    )
    waits = [
        audio - stop
        for s in admitted + ended
        for stop, audio in zip(s.stopped_at, s.first_audio, strict=True)
        if audio is not None
    ]
    print(
        f"  admitted sessions' speech_stopped -> first audio: p50 {pct(waits, 0.5):.2f} s, "
        f"p90 {pct(waits, 0.9):.2f} s over {len(waits)} turns"
    )
    for message in sorted(set(errors))[:5]:
        print(f"    error event: {message}")
    failed = []
    if limit is not None and len(admitted) + len(ended) != min(limit, len(sessions)):
        failed.append(f"{len(admitted) + len(ended)} admitted, not {min(limit, len(sessions))}")
    if other:
        failed.append("a refusal was not server_busy + 1013")
    if heard < asked:
        failed.append(f"{asked - heard} admitted turns without audio")
    if errors:
        failed.append(f"{len(errors)} error events")
    if closes:
        failed.append(f"{len(closes)} admitted sessions closed by the server")
    print(
        "past capacity: "
        + (
            "OK (refused at open, every admitted turn answered, no error, no 1011)"
            if not failed
            else "NOT OK: " + "; ".join(failed)
        )
    )
    return not failed


def report(
    sessions: list[Session], peer: list[float], floor: Floor, args: argparse.Namespace
) -> None:
    # Refused clients asked nothing: the figures below are the admitted sessions'.
    sessions = [s for s in sessions if s.refused is None]
    from_speech: list[float] = []
    from_stop: list[float] = []
    server_lag: list[tuple[float, float]] = []
    waits: list[tuple[float, float]] = []  # (turn end, its wait for first audio), by time
    turns: list[tuple[float, bool]] = []  # (turn end, whether any answer audio came)
    asked = answered = unanswered = 0
    for s in sessions:
        asked += len(s.spoken_end)
        for stop, audio in zip(s.stopped_at, s.first_audio, strict=True):
            # The spoken end just before this stop is the turn it closed.
            ends = [e for e in s.spoken_end if e <= stop]
            dues = [d for d in s.stop_due if d - args.silence_ms / 1000 <= stop]
            if dues:
                server_lag.append((stop, stop - dues[-1]))
            turns.append((stop, audio is not None))
            if audio is None:
                unanswered += 1
            elif ends:
                answered += 1
                from_speech.append(audio - ends[-1])
                from_stop.append(audio - stop)
                waits.append((stop, audio - stop))
    send_lag = max((max(s.send_lag) for s in sessions if s.send_lag), default=0.0)
    errors = sorted({e for s in sessions for e in s.errors})
    med = median(from_speech)
    peer_med = median(peer)
    print(
        f"sessions {len(sessions)} admitted of {args.clients} clients, {args.duration:g} s, "
        f"a question every {args.period:g} s"
    )
    if args.truncation_tokens is not None:
        print(
            f"truncation: retention_ratio {args.retention_ratio:g}, "
            f"post_instructions {args.truncation_tokens}"
        )
    print(
        f"questions asked {asked}, answered with audio {answered}, no audio before the next "
        f"question cancelled the answer (or the run ended) {unanswered}"
    )
    print(
        f"end of speech -> first audio: median {med:.2f} s, p90 {pct(from_speech, 0.9):.2f} s "
        f"(includes the {args.silence_ms} ms VAD silence window)"
    )
    print(
        f"speech_stopped -> first audio: median {pct(from_stop, 0.5):.2f} s, "
        f"p90 {pct(from_stop, 0.9):.2f} s"
    )
    if peer:
        print(f"peer (HTTP cascade, one at a time, idle): median {peer_med:.2f} s over {len(peer)}")
        print(f"ratio realtime/peer: {med / peer_med:.2f}x")
    else:
        print("peer: not measured (--peer-runs 0)")
    first, last = (median(part) for part in thirds(server_lag))
    behind = send_lag > 1.0 or (last - first) > 1.0
    # Output side: answers fall behind when the wait for first audio grows over the run.
    w_first, w_last = (median(part) for part in thirds(waits))
    lost_first, lost_last = (part.count(False) for part in thirds(turns))
    answers_behind = (w_last - w_first) > 1.0 or lost_last > lost_first
    print(
        f"server VAD lag (speech_stopped after its audio): first third {first:.2f} s, last third "
        f"{last:.2f} s; max client send lag {send_lag:.2f} s -> audio in "
        + ("FELL BEHIND real time" if behind else "kept up with real time")
    )
    print(
        f"speech_stopped -> first audio, turns in time order: median of the first third "
        f"{w_first:.2f} s, last third {w_last:.2f} s; turns with no audio {lost_first} vs "
        f"{lost_last} -> answers "
        + ("FELL BEHIND (the wait grows)" if answers_behind else "kept up (the wait does not grow)")
    )
    stages = [st for s in sessions for st in s.stages]
    if stages:
        stt, llm, tts = (statistics.median(x) for x in zip(*stages, strict=True))
        print(
            f"median stages: speech_stopped -> transcript {stt:.2f} s, -> first text "
            f"{llm:.2f} s, -> first audio {tts:.2f} s"
        )
    stalls = [x for s in sessions for x in s.stalls]
    if stalls:
        gapped = sum(1 for x in stalls if x > 0.05)
        print(
            f"answer playback: {gapped} of {len(stalls)} answers had gaps (audio late for its "
            f"turn to play), total {sum(stalls):.1f} s, worst {max(stalls):.2f} s"
        )
    tokens = [t for t in floor.piece_tokens if t]
    if tokens:
        k = statistics.median(tokens)
        best = k * floor.step + floor.speech
        print(
            f"floor (what this machine allows at best, measured idle in this run): the first "
            f"piece's median {k:g} tokens x {floor.step * 1000:.0f} ms a step with "
            f"{args.sessions} rows decoding + {floor.speech:.2f} s to the first audio of a "
            f"5-word piece = {best:.2f} s (leaves out transcription, the prompt pass of a "
            f"joining turn, and every other session's CPU); ratio speech_stopped median/floor: "
            f"{pct(from_stop, 0.5) / best:.2f}x"
        )
    print(f"errors: {errors or 'none'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sessions",
        type=int,
        default=8,
        help="the session cap: the server started gets --parallel and --audio-queue-depth for "
        "it (the floor is measured with this many rows)",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help="clients that open at once (default: --sessions); past the cap they must be "
        "refused at open, and the exit status is 1 when the past-capacity checks fail",
    )
    p.add_argument("--duration", type=float, default=300.0, help="seconds of speaking per session")
    p.add_argument("--period", type=float, default=10.0, help="seconds between questions")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--silence-ms", type=int, default=400, help="server VAD silence window")
    p.add_argument("--model", default=None, help="chat model (default: the embedded SmolLM2)")
    p.add_argument("--url", default=None, help="use a running server instead of starting one")
    p.add_argument("--port", type=int, default=18940)
    p.add_argument("--peer-runs", type=int, default=3)
    p.add_argument(
        "--truncation-tokens",
        type=int,
        default=None,
        help="sessions ask for truncation with this post_instructions budget (default: auto)",
    )
    p.add_argument("--retention-ratio", type=float, default=0.5)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="another flag for the server it starts, e.g. --server-arg=--no-spec-ngram",
    )
    args = p.parse_args()
    crowding = args.clients is not None
    if args.clients is None:
        args.clients = args.sessions
    proc = None
    ok = True
    base = args.url
    if base is None:
        proc, base = start_server(args)
    try:
        for q in QUESTIONS:
            spoken(q)  # synthesize the questions before any timing
        peer = []
        for i in range(args.peer_runs + 1):
            secs = peer_once(base, spoken(QUESTIONS[i % len(QUESTIONS)]), args.max_tokens)
            if i:  # the first run loads the models
                peer.append(secs)
        cap = session_cap(base)
        floor = Floor(trio.run(decode_step, base, args.sessions), first_piece_audio(base))
        sessions = trio.run(run_sessions, base, args)
        floor.piece_tokens = first_piece_tokens(base, [a for s in sessions for a in s.answers])
        report(sessions, peer, floor, args)
        ok = past_capacity(sessions, cap)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if crowding and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
