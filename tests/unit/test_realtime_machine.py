"""The realtime session's state machine on its own: inputs in, actions out, no Trio, no clock,
no socket, no models. Each test plays what the session's tasks would report and checks what the
machine tells them (and the client) next."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

from mlxcel.actors.realtime import events as ev
from mlxcel.actors.realtime.answer import SPEAK_AHEAD_SECONDS
from mlxcel.actors.realtime.config import SessionConfig, SessionPatch, TurnDetection
from mlxcel.actors.realtime.machine import MAX_PENDING_JOBS, SessionMachine
from mlxcel.actors.realtime.vad import VadEvent
from mlxcel.runtime.messages import SamplingParams

T = TypeVar("T")
RATE = 16_000
OUT = 16_000  # output rate in these tests: 1 s of audio is 16 000 samples


def machine(
    *,
    vad: bool = True,
    needs_configure: bool = False,
    multi_turn: bool = True,
    output_audio: bool = True,
) -> SessionMachine:
    counter = itertools.count()
    cfg = SessionConfig(
        model="m",
        multi_turn=multi_turn,
        turn_detection=TurnDetection() if vad else None,
        output_audio=output_audio,
        input_rate=RATE,
        output_rate=OUT,
        instructions="Be brief.",
    )
    m = SessionMachine(
        session_id="sess",
        config=cfg,
        needs_configure=needs_configure,
        sampling=SamplingParams(),
        now=0.0,
        voice_error=lambda voice: None if voice in (None, "amy") else f"Unknown voice '{voice}'.",
        ids=lambda prefix: f"{prefix}_{next(counter)}",
    )
    m.start()
    return m


def got(m: SessionMachine, message: ev.ClientMessage, now: float = 1.0) -> list[ev.Action]:
    return m.feed(ev.Received(message, now))


def sent(actions: Sequence[ev.Action]) -> list[ev.ServerEvent]:
    return [a.event for a in actions if isinstance(a, ev.Send)]


def kinds(actions: Sequence[ev.Action]) -> list[str]:
    """Action and event names in order (a Send shows as its event's name)."""
    return [type(a.event if isinstance(a, ev.Send) else a).__name__ for a in actions]


def only(items: Sequence[object], kind: type[T]) -> T:
    found = [a for a in items if isinstance(a, kind)]
    assert len(found) == 1, items
    return found[0]


def errors(actions: Sequence[ev.Action]) -> list[ev.Error]:
    return [e for e in sent(actions) if isinstance(e, ev.Error)]


def audio(seconds: float) -> ev.AppendAudio:
    return ev.AppendAudio(np.zeros(int(seconds * RATE), np.int16))


def speech(m: SessionMachine, *found: VadEvent, now: float = 1.0) -> list[ev.Action]:
    return m.feed(ev.SpeechDetected(found, now))


def answer(m: SessionMachine, actions: Sequence[ev.Action]) -> str:
    """Play an answer's start: the context fits as it is; returns its response id."""
    start = only(actions, ev.StartResponse)
    only(m.feed(ev.ContextFitted(start.response_id, start.context_from)), ev.Submit)
    m.feed(ev.Accepted(start.response_id, 12))
    return start.response_id


def speak_piece(m: SessionMachine, rid: str, piece: str, seconds: float, clock: float) -> list[Any]:
    """The speaker takes ``piece`` and synthesizes ``seconds`` of it; returns the actions."""
    out = m.feed(ev.SpeakNext(rid, piece, clock))
    out += m.feed(ev.Synthesized(rid, np.zeros(int(seconds * OUT), np.int16), clock))
    return out


# --- the handshake and bad client events -----------------------------------------------------


def test_voicechat_handshake_then_a_second_update_is_refused() -> None:
    m = machine(vad=False, needs_configure=True, multi_turn=False)
    assert m.deadline == 30.0  # CONFIGURE_TIMEOUT_SECONDS from the start
    before = got(m, audio(0.5))
    assert [e.message for e in errors(before)] == ["send session.update before audio"]
    patch = SessionPatch()
    patch.set("turn_detection", TurnDetection(silence_duration_ms=300))
    patch.set("multi_turn", True)
    out = got(m, ev.UpdateSession(patch), now=2.0)
    assert kinds(out) == ["SetDetector", "SessionUpdated"]
    assert m.cfg.multi_turn and m.deadline == 2.0 + m.cfg.idle_timeout
    again = got(m, ev.UpdateSession(SessionPatch()))
    assert [(e.code, e.message) for e in errors(again)] == [
        ("session_initialization_failed", "the session is already configured")
    ]
    # Even a malformed second update gets the same answer: the state refuses it first.
    bad = ev.Refused("'session.colour' is not supported", event=True, kind="session.update")
    assert errors(got(m, bad))[0].message == "the session is already configured"


def test_a_malformed_first_update_fails_initialization_and_an_unknown_voice_is_named() -> None:
    m = machine(needs_configure=True)
    bad = ev.Refused(
        "'session.seed' must be ...", param="session.seed", event=True, kind="session.update"
    )
    assert [(e.code, e.param) for e in errors(got(m, bad))] == [
        ("session_initialization_failed", "session.seed")
    ]
    patch = SessionPatch()
    patch.set("voice", "nobody")
    refused = errors(got(m, ev.UpdateSession(patch)))
    assert [(e.param, e.message) for e in refused] == [("session.voice", "Unknown voice 'nobody'.")]
    assert not m.configured


def test_bad_client_events_are_errors_and_the_session_goes_on() -> None:
    m = machine(vad=False, needs_configure=True)
    # Not an event at all: its own error, configured or not.
    not_json = ev.Refused("message must be a JSON object")
    assert errors(got(m, not_json))[0].message == "message must be a JSON object"
    # An event that needs a configured session says so first...
    bad_create = ev.Refused("'response' must be an object", event=True, kind="response.create")
    assert errors(got(m, bad_create))[0].message == "send session.update before audio"
    unknown = ev.Refused("unsupported event type 'x'", event=True, kind="x")
    assert errors(got(m, unknown))[0].message == "send session.update before audio"
    got(m, ev.UpdateSession(SessionPatch()))
    # ...and then its own error.
    assert errors(got(m, bad_create))[0].param is None
    assert errors(got(m, unknown))[0].message == "unsupported event type 'x'"
    bad_audio = ev.Refused("'audio' is not valid base64", "inference_error", "audio", True, "x")
    assert errors(got(m, bad_audio))[0].code == "inference_error"
    assert kinds(got(m, ev.Ping())) == ["Pong"]
    assert m.closing is None


def test_response_cancel_without_an_answer_and_the_timeouts() -> None:
    m = machine(vad=False)
    assert errors(got(m, ev.CancelResponse()))[0].code == "response_cancel_not_active"
    idle = m.feed(ev.TimedOut(m.deadline))
    assert errors(idle)[0].code == "idle_timeout"
    assert only(idle, ev.Close) == ev.Close(1008, "idle timeout")
    capped = machine(vad=False)
    capped.feed(ev.Received(ev.Ping(), capped.cfg.max_seconds - 1))
    out = capped.feed(ev.TimedOut(capped.cfg.max_seconds))
    assert errors(out)[0].code == "session_expired"
    late = machine(needs_configure=True)
    assert only(late.feed(ev.TimedOut(30.0)), ev.Close).reason == "session not configured in time"


def test_the_input_buffer_is_bounded() -> None:
    m = machine(vad=False)
    assert not errors(got(m, audio(100)))
    full = errors(got(m, audio(30)))
    assert [e.code for e in full] == ["input_audio_buffer_full"]
    assert m.buffer.samples == 100 * RATE  # the refused audio was dropped
    assert kinds(got(m, ev.ClearAudio())) == ["Cleared"]
    assert m.buffer.samples == 0


# --- turns: manual commits and server VAD ----------------------------------------------------


def test_a_manual_commit_transcribes_then_answers() -> None:
    m = machine(vad=False)
    empty = errors(got(m, ev.CommitAudio()))
    assert [e.code for e in empty] == ["input_audio_buffer_commit_empty"]
    got(m, audio(1.0))
    out = got(m, ev.CommitAudio(), now=5.0)
    assert kinds(out) == ["Committed", "UserItem", "Transcribe"]
    item = only(out, ev.Transcribe).item_id
    assert m.turn_ended_at == 5.0 and m.buffer.samples == 0
    out = m.feed(ev.Transcribed(item, "What is the capital of France?"))
    assert kinds(out) == ["Transcript", "ResponseCreated", "StartResponse"]
    start = only(out, ev.StartResponse)
    assert start.system == "Be brief." and start.request.priority == 0
    submit = only(m.feed(ev.ContextFitted(start.response_id, 0)), ev.Submit)
    assert submit.request.prompt.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    )


def test_server_vad_commits_the_turn_and_keeps_only_the_padding() -> None:
    m = machine()
    appended = got(m, audio(3.0))
    assert kinds(appended) == ["DetectSpeech"]
    out = speech(m, VadEvent("start", 16_000))
    assert kinds(out) == ["SpeechStarted"]
    assert sent(out)[0] == ev.SpeechStarted("item_0", 1000)
    # The silence before the speech (and its 300 ms of padding) is dropped.
    assert m.buffer.start_sample == 16_000 - 300 * 16
    out = speech(m, VadEvent("stop", 40_000), now=9.0)
    assert kinds(out) == ["SpeechStopped", "ResetDetector", "Committed", "UserItem", "Transcribe"]
    assert only(out, ev.Transcribe).item_id == "item_0" and m.turn_ended_at == 9.0


def test_server_vad_without_create_response_commits_but_does_not_answer() -> None:
    m = machine()
    patch = SessionPatch()
    patch.set("turn_detection", TurnDetection(create_response=False))
    got(m, ev.UpdateSession(patch))
    got(m, audio(2.0))
    speech(m, VadEvent("start", 0))
    item = only(speech(m, VadEvent("stop", 20_000)), ev.Transcribe).item_id
    assert kinds(m.feed(ev.Transcribed(item, "hello"))) == ["Transcript"]
    assert [i.text for i in m.history] == ["hello"]


def test_early_transcription_at_a_pause_serves_the_turn() -> None:
    m = machine()
    got(m, audio(2.0))
    speech(m, VadEvent("start", 0))
    early = only(speech(m, VadEvent("pause", 20_000)), ev.StartEarly)
    assert early.audio.size == m.buffer.samples
    assert m.feed(ev.EarlyTranscribed(early.token, "hello there")) == []
    out = speech(m, VadEvent("stop", 20_000))
    assert not any(isinstance(a, ev.Transcribe) for a in out)  # the early one is used
    assert ev.Transcript("item_0", "hello there") in sent(out)
    assert "StartResponse" in kinds(out)


def test_speech_resuming_cancels_the_early_transcription_and_the_turn_transcribes() -> None:
    m = machine()
    got(m, audio(2.0))
    speech(m, VadEvent("start", 0))
    first = only(speech(m, VadEvent("pause", 8_000)), ev.StartEarly)
    assert only(speech(m, VadEvent("resume", 10_000)), ev.CancelEarly).token == first.token
    m.feed(ev.EarlyTranscribed(first.token, None))  # its task ends, cancelled
    second = only(speech(m, VadEvent("pause", 20_000)), ev.StartEarly)
    assert second.token != first.token
    # The turn ends before the early transcript is ready: it waits for it...
    assert not any(isinstance(a, ev.Transcribe) for a in speech(m, VadEvent("stop", 20_000)))
    # ...which fails, so the turn transcribes its audio itself.
    assert only(m.feed(ev.EarlyTranscribed(second.token, None)), ev.Transcribe).item_id == "item_0"


def test_a_failed_transcription_is_an_error_and_a_one_shot_session_closes() -> None:
    m = machine(vad=False, multi_turn=False)
    got(m, audio(1.0))
    item = only(got(m, ev.CommitAudio()), ev.Transcribe).item_id
    out = m.feed(ev.Transcribed(item, None, "model fell over"))
    assert [e.message for e in errors(out)] == ["transcription failed: model fell over"]
    assert only(out, ev.Close) == ev.Close(1000, "turn complete")


# --- answers: text, speech, barge-in ---------------------------------------------------------


def test_a_text_answer_streams_and_completes() -> None:
    m = machine(vad=False, output_audio=False, multi_turn=False)
    rid = answer(m, got(m, ev.CreateResponse()))
    out = m.feed(ev.Generated(rid, "Paris.", 0.0))
    assert kinds(out) == ["TextDelta"]  # no speech for a text answer
    assert m.feed(ev.GenerationDone(rid)) == []
    m.feed(ev.Usage(rid, 3))
    out = m.feed(ev.ResponseEnded(rid, "completed"))
    done = only(sent(out), ev.ResponseDone)
    assert done.response.status == "completed" and done.response.output_tokens == 3
    assert done.response.input_tokens == 12
    assert only(out, ev.Close) == ev.Close(1000, "turn complete")
    assert [(i.role, i.text) for i in m.history] == [("assistant", "Paris.")]


def test_a_failed_answer_reports_the_error_before_its_end() -> None:
    m = machine(vad=False)
    rid = answer(m, got(m, ev.CreateResponse(instructions="Shout.")))
    out = m.feed(ev.ResponseEnded(rid, "failed", "server_error", "prompt too long"))
    assert kinds(out) == ["Error", "ResponseDone"]
    assert errors(out)[0].message == "answer failed: prompt too long"
    assert sent(out)[1].response.reason == "server_error"


def test_a_spoken_answer_is_split_into_pieces_and_its_audio_into_deltas() -> None:
    m = machine(vad=False)
    rid = answer(m, got(m, ev.CreateResponse()))
    speak = only(m.feed(ev.Generated(rid, "The capital of France is Paris. It ", 0.0)), ev.Speak)
    assert speak.piece == "The capital of France is Paris."
    out = speak_piece(m, rid, speak.piece, seconds=0.6, clock=100.0)
    say = only(out, ev.Synthesize)
    assert say.wait == 0 and say.deadline is None  # the first piece is wanted now
    deltas = [a for a in out if isinstance(a, ev.Send) and isinstance(a.event, ev.AudioDelta)]
    assert [len(d.event.pcm) // 2 for d in deltas] == [4000, 4000, 1600]
    assert [d.first_of_piece for d in deltas] == [0, None, None]
    assert kinds(out)[1] == "Spoken"
    m.feed(ev.PieceDone(rid))
    assert only(m.feed(ev.GenerationDone(rid)), ev.Speak).piece == "It"


def test_speech_is_paced_to_stay_a_little_ahead_of_playback() -> None:
    m = machine(vad=False)
    rid = answer(m, got(m, ev.CreateResponse()))
    speak_piece(m, rid, "One.", seconds=5.0, clock=100.0)  # playback runs until 105
    m.feed(ev.PieceDone(rid))
    later = only(m.feed(ev.SpeakNext(rid, "Two.", 101.0)), ev.Synthesize)
    assert later.deadline == 105.0
    assert later.wait == pytest.approx(105.0 - SPEAK_AHEAD_SECONDS - 101.0)
    assert only(m.feed(ev.SpeakNext(rid, "Two.", 104.0)), ev.Synthesize).wait == 0


def test_a_listener_about_to_run_dry_gets_the_words_there_are() -> None:
    m = machine(vad=False)
    rid = answer(m, got(m, ev.CreateResponse()))
    first = only(m.feed(ev.Generated(rid, "Yes, of course. ", 0.0)), ev.Speak)
    speak_piece(m, rid, first.piece, seconds=2.0, clock=100.0)  # heard until 102
    m.feed(ev.PieceDone(rid))
    # With time to spare, half a sentence waits for its end...
    assert m.feed(ev.Generated(rid, "The answer to that is", 99.0))[1:] == []
    # ...but with under HURRY_SECONDS of audio left, the whole words go now.
    hurried = only(m.feed(ev.Generated(rid, " rather ", 101.0)), ev.Speak)
    assert hurried.piece == "The answer to that is rather"


def test_barge_in_cancels_the_answer_and_keeps_what_was_heard() -> None:
    m = machine()
    rid = answer(m, got(m, ev.CreateResponse()))
    m.feed(ev.Generated(rid, "First sentence here. Second one. ", 0.0))
    speak_piece(m, rid, "First sentence here.", seconds=0.5, clock=100.0)
    m.feed(ev.Written(rid, 0))  # its first audio reached the socket
    m.feed(ev.PieceDone(rid))
    speak_piece(m, rid, "Second one.", seconds=0.5, clock=100.5)  # still in the outbox
    got(m, audio(1.0))
    out = speech(m, VadEvent("start", 0))
    assert kinds(out) == ["SpeechStarted", "Purge", "ResponseDone", "CancelGeneration"]
    done = sent(out)[1]
    assert isinstance(done, ev.ResponseDone)
    assert (done.response.status, done.response.reason) == ("cancelled", "turn_detected")
    assert done.response.spoken == "First sentence here."
    assert [(i.role, i.text) for i in m.history] == [("assistant", "First sentence here.")]
    # News of the cancelled answer changes nothing.
    assert m.feed(ev.Generated(rid, "more", 101.0)) == []


def test_a_new_turn_cancels_the_answer_and_waits_for_it_to_unwind() -> None:
    m = machine(vad=False)
    rid = answer(m, got(m, ev.CreateResponse()))
    m.feed(ev.Generated(rid, "Partial", 0.0))
    got(m, audio(1.0))
    out = got(m, ev.CommitAudio())
    assert kinds(out) == ["Committed", "UserItem", "Purge", "ResponseDone", "CancelGeneration"]
    assert sent(out)[-1].response.text == "Partial"
    # The turn is transcribed only once the cancelled answer's task has ended.
    out = m.feed(ev.ResponseEnded(rid, "cancelled"))
    assert kinds(out) == ["Transcribe"]


def test_interrupt_response_off_lets_the_answer_finish_before_the_turn() -> None:
    m = machine()
    patch = SessionPatch()
    patch.set("turn_detection", TurnDetection(interrupt_response=False))
    got(m, ev.UpdateSession(patch))
    rid = answer(m, got(m, ev.CreateResponse()))
    got(m, audio(1.0))
    out = speech(m, VadEvent("start", 0)) + speech(m, VadEvent("stop", 12_000))
    assert "CancelGeneration" not in kinds(out) and "Transcribe" not in kinds(out)
    out = m.feed(ev.ResponseEnded(rid, "completed"))
    assert kinds(out) == ["ResponseDone", "Transcribe"]


def test_session_cancel_reports_the_answer_then_closes() -> None:
    m = machine(vad=False)
    answer(m, got(m, ev.CreateResponse()))
    out = got(m, ev.CancelSession())
    assert kinds(out) == ["Purge", "ResponseDone", "CancelGeneration", "Close"]
    assert only(out, ev.Close) == ev.Close(1000, "session cancelled")
    assert sent(got(m, ev.Ping())) == []  # closing: nothing more goes out


def test_shutdown_ends_the_answer_and_closes_going_away() -> None:
    m = machine(vad=False)
    answer(m, got(m, ev.CreateResponse()))
    out = m.feed(ev.ShutDown())
    assert kinds(out) == ["Purge", "ResponseDone", "CancelGeneration", "Error", "Close"]
    assert sent(out)[0].response.reason == "server_shutting_down"
    assert only(out, ev.Close).code == 1001


def test_the_session_ending_under_an_answer_reports_it_closed() -> None:
    m = machine(vad=False)
    rid = answer(m, got(m, ev.CreateResponse()))
    done = sent(m.feed(ev.ResponseEnded(rid, "cancelled")))
    assert done[0].response.reason == "session_closed"


# --- the order of jobs -----------------------------------------------------------------------


def test_jobs_run_one_at_a_time_and_only_so_many_wait() -> None:
    m = machine(vad=False)
    first = answer(m, got(m, ev.CreateResponse()))
    item = ev.Item("item_x", "user", "typed")
    assert sent(got(m, ev.CreateItem(item))) == []  # it waits behind the answer
    for _ in range(MAX_PENDING_JOBS - 1):
        assert not errors(got(m, ev.CreateResponse()))
    busy = errors(got(m, ev.CreateResponse()))
    assert [e.code for e in busy] == ["server_busy"]
    out = m.feed(ev.ResponseEnded(first, "completed"))
    # The answer ends, the item joins the conversation, the next answer starts.
    assert kinds(out) == ["ResponseDone", "UserItem", "ResponseCreated", "StartResponse"]
    assert sent(out)[1] == ev.UserItem("item_x", None, "typed")
    assert only(out, ev.StartResponse).items == (item,)


def test_the_machine_needs_no_trio_and_no_server() -> None:
    code = (
        "import sys, mlxcel.actors.realtime.machine, mlxcel.actors.realtime.answer; "
        "print(sorted(m for m in ('trio', 'quart', 'hypercorn', 'mlxcel.http') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
