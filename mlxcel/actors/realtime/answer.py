"""One answer of a realtime session, as plain state: the text it streams, the pieces it speaks
and when, the audio that went out, and what of it the user heard when it is cut off.

``machine.py`` owns the answer while it runs and turns what these steps return into actions.
``fit_context`` (where the conversation is cut for the prompt) is the one blocking step: the
session's answer task runs it in a thread.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np

from mlxcel.actors.realtime import events as ev
from mlxcel.actors.realtime.config import ResponseState
from mlxcel.actors.realtime.sentences import SentenceSplitter
from mlxcel.runtime.messages import ChatPrompt, GenerationRequest
from mlxcel.runtime.truncation import budget, first_kept

# Longest audio delta sent in one event, in seconds (finer pieces start playback sooner and
# let barge-in drop more of what was not heard).
AUDIO_DELTA_SECONDS = 0.25
# How far ahead of the client's playback an answer is spoken. Speech costs ~0.17 s of CPU per
# second of audio here, and a barge-in throws away whatever was spoken but not yet heard, so
# an answer is synthesized only this far ahead: enough to ride out a busy moment, while the
# CPU goes to turns that are waiting for their first word.
SPEAK_AHEAD_SECONDS = 2.5
# Speak the words there are (not the whole sentence) when the client's audio runs out sooner.
HURRY_SECONDS = 1.5


@attrs.define(eq=False)
class Answer:
    """An answer from its start until its task ends (``state`` is what the client is told)."""

    state: ResponseState
    job: ev.CreateResponse
    request: GenerationRequest  # without its prompt, which is built once the context fits
    items: list[ev.Item]  # the conversation when the answer started (for fit_context)
    out_rate: int
    splitter: SentenceSplitter = attrs.field(factory=SentenceSplitter)
    # Pieces whose first audio is queued for the client and not yet written (purgeable).
    unsent: set[int] = attrs.field(factory=set)
    piece: str = ""  # the piece being spoken
    piece_index: int | None = None  # its index in spoken_pieces, once its audio went out

    @property
    def id(self) -> str:
        return self.state.id

    def snapshot(self) -> ResponseState:
        """A copy for an event (the answer goes on changing)."""
        return attrs.evolve(self.state, spoken_pieces=list(self.state.spoken_pieces))

    def generated(self, text: str, clock: float) -> list[str]:
        """Add generated text; return the pieces now ready to speak."""
        r = self.state
        r.text += text
        if not r.output_audio:
            return []
        pieces = self.splitter.feed(text, hurry=starving(r, self.out_rate, clock))
        r.pieces_pending += len(pieces)
        return pieces

    def flush(self) -> list[str]:
        """Generation ended: what is left to speak."""
        if not self.state.output_audio or not (rest := self.splitter.flush()):
            return []
        self.state.pieces_pending += 1
        return [rest]

    def pace(self, piece: str, clock: float) -> tuple[float, float | None]:
        """The speaker takes ``piece``: how long to wait before synthesizing it, and the
        deadline its speech is wanted by (None: now)."""
        self.piece, self.piece_index = piece, None
        # The TTS worker serves the earliest deadline first: the first piece is wanted now;
        # each later one when the client will have played what came before it.
        deadline = self.state.playback_end(self.out_rate)
        wait = 0.0 if deadline is None else max(0.0, deadline - SPEAK_AHEAD_SECONDS - clock)
        return wait, deadline

    def synthesized(self, pcm: np.ndarray, clock: float) -> list[ev.Send]:
        """Speech of the current piece, as the events that carry it to the client."""
        r = self.state
        out: list[ev.Send] = []
        step = int(AUDIO_DELTA_SECONDS * self.out_rate)
        for start in range(0, pcm.size, step):
            part = pcm[start : start + step]
            first = self.piece_index is None
            if r.playback_from is None:
                r.playback_from = clock
            if self.piece_index is None:
                # The piece counts as heard from its first audio on.
                self.piece_index = len(r.spoken_pieces)
                r.spoken_pieces.append(self.piece)
                self.unsent.add(self.piece_index)
                out.append(ev.Send(ev.Spoken(self.snapshot(), self.piece), response_id=r.id))
            delta = ev.AudioDelta(self.snapshot(), part.tobytes())
            index = self.piece_index if first else None
            out.append(ev.Send(delta, response_id=r.id, first_of_piece=index))
            r.audio_samples += part.size
        return out

    def cancel(self, reason: str) -> None:
        """Cut off: only the pieces whose first audio was written count as heard (the rest
        is purged from the outbox)."""
        r = self.state
        r.status, r.reason = "cancelled", reason
        if self.unsent:
            r.spoken_pieces = r.spoken_pieces[: min(self.unsent)]


def starving(r: ResponseState, out_rate: int, clock: float) -> bool:
    """Will the client run out of this answer's audio soon, with nothing more on the way?
    Then the text-to-speech takes whatever whole words there are rather than waiting for the
    sentence to end (a gap in a spoken answer is worse than a phrase break)."""
    runs_dry = r.playback_end(out_rate)
    if runs_dry is None or r.pieces_pending > 0:
        return False
    return runs_dry - clock < HURRY_SECONDS


def prompt(system: str, items: list[ev.Item]) -> tuple[dict[str, object], ...]:
    """The instructions (if any), then the items."""
    msgs: list[dict[str, object]] = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": i.role, "content": i.text} for i in items]
    return tuple(msgs)


def fit_context(
    count: Callable[[GenerationRequest], int] | None,
    context_length: int,
    start: ev.StartResponse,
) -> int:
    """Where the cut goes for this answer's prompt (runtime/truncation.py). Blocking (run it
    in a thread): it encodes the prompt once, and ~log2(items) more times when it cuts."""
    truncation = start.truncation
    if count is None or truncation is None or not context_length:
        return start.context_from
    items, system, request = list(start.items), start.system, start.request

    def tokens(k: int) -> int:
        chat = ChatPrompt(messages=prompt(system, items[k:]))
        return count(attrs.evolve(request, prompt=chat))

    # No instructions: nothing precedes the conversation (a prompt of no messages cannot
    # be rendered, and every answer of such a session failed).
    base = tokens(len(items)) if system else 0
    limit = budget(
        truncation, context=context_length, instructions=base, max_output=request.max_tokens
    )
    ratio = truncation.retention_ratio
    return first_kept(len(items), start.context_from, lambda k: tokens(k) - base, limit, ratio)


__all__ = [
    "AUDIO_DELTA_SECONDS",
    "HURRY_SECONDS",
    "SPEAK_AHEAD_SECONDS",
    "Answer",
    "fit_context",
    "prompt",
    "starving",
]
