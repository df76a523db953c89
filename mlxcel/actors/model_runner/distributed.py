"""Tensor parallel over mlx's distributed layer (``mlxcel serve --distributed``).

Every rank holds a shard of the model (``model.shard(group)``: each layer's heads and MLP
columns split, an ``all_sum`` inside every forward pass), so every rank must run exactly the
same forward passes in the same order. Rank 0 runs HTTP and the scheduler as ever; its backend
broadcasts each ``StepPlan`` before applying it, and ranks > 0 loop receiving plans and
applying them to their own backend (their outputs are discarded), until rank 0 sends the stop
message. What makes the steps identical: the plan (requests, sampling parameters and seeds),
the same mx.random seed on every rank at start, and no time-dependent decision inside
``apply`` (``distributed_settings`` turns speculation and the prefill budget off).

The broadcast is two ``all_sum`` collectives, since mlx has no broadcast: the plan's length,
then its pickled bytes as int32 words (zero-padded), with
zeros from every other rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from mlxcel.actors.model_runner.backend import Backend, ModelInfo
from mlxcel.models.errors import ModelError
from mlxcel.runtime.messages import StepOutput, StepPlan
from mlxcel.runtime.settings import Settings

log = logging.getLogger(__name__)

# What every rank seeds mx.random with before loading: unseeded sampling then draws the same
# numbers on every rank, as long as the ranks run the same steps.
SEED = 0
# The lengths that tell ranks > 0 to stop, and that rank 0 is alive and idle.
_STOP = -1
_PING = 0
# Rank 0 pings this often while idle, so a rank that died is noticed without a request.
PING_S = 1.0


class RankLost(ModelError):
    """A collective failed: another rank died or its connection broke."""


# Set once rank 0 lost a rank (before it signals itself to stop): the server then drains in
# ``LOST_GRACE_S`` instead of the graceful timeout, since no generation can step again, and
# the CLI reads this to exit non-zero all the same.
lost: list[RankLost] = []
# The drain after a lost rank: long enough for every handler to write its ending (generations
# are interrupted at half of it), shorter than ``Watchdog.DRAIN_S``.
LOST_GRACE_S = 1.0


class Watchdog:
    """Ends the process when one collective or step takes longer than ``deadline_s``: a
    stalled peer would otherwise hold a collective forever, and mlx cannot interrupt one.

    ``drain`` (rank 0): first SIGTERM itself, so the server drains as after any lost rank
    (/health answers 503, each response in flight gets its ending) for ``DRAIN_S``; then
    ``os._exit``, the only way out of a thread stuck in an mlx collective (mlx has no way to
    abort one). The exit status says why."""

    EXIT_STATUS = 3
    DRAIN_S = 2.0

    def __init__(self, deadline_s: float, *, drain: bool = False) -> None:
        self._deadline = deadline_s
        self._drain = drain
        self._since: float | None = None
        self._what = ""
        name = "mlxcel-distributed-watchdog"
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.5, self._deadline / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self._deadline:
                log.error(
                    "distributed: %s took over %.0f s (a rank stalled or died): exiting",
                    self._what,
                    self._deadline,
                )
                if self._drain:
                    lost.append(RankLost(f"distributed: {self._what} stalled (a rank stalled)"))
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(self.DRAIN_S)
                logging.shutdown()
                os._exit(self.EXIT_STATUS)


def init_group() -> Any:
    """The group of all ranks, as ``mlx.launch`` (or MLX_RANK / MLX_HOSTFILE) describes it."""
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as error:  # no backend, or no MLX_RANK / MLX_HOSTFILE to form it
        why = f"--distributed: no group of ranks ({error}); start the ranks with mlx.launch"
        raise ModelError(why) from error
    if group.size() < 2:
        raise ModelError("--distributed needs at least two ranks (start them with mlx.launch)")
    return group


def start_rank() -> Any:
    """Join the group and seed mx.random as every other rank does, before anything loads."""
    group = init_group()
    mx.random.seed(SEED)
    return group


def distributed_settings(settings: Settings) -> Settings:
    """Settings every rank runs with: nothing inside a step may depend on time or on what only
    rank 0 knows. Speculation adapts to measured step costs and the prefill budget to measured
    read times, so both are off; a draft model is refused when the flags are read."""
    return attrs.evolve(settings, spec_ngram=False, prefill_share=1.0)


class PlanChannel:
    """Rank 0 sends plans, every other rank receives them, over the group's collectives."""

    def __init__(self, group: Any, watchdog: Watchdog) -> None:
        self._group = group
        self._watchdog = watchdog

    def _sum(self, x: mx.array) -> mx.array:
        try:
            with self._watchdog.watch("a collective"):
                return self._all_sum(x)
        except RuntimeError as error:  # mlx's ring: "connection to a peer was lost"
            raise RankLost(f"distributed: lost a rank: {error}") from error

    def _all_sum(self, x: mx.array) -> mx.array:
        # On the generation stream: the batch generator evaluates the next step's forward
        # pass (whose own all_sums cross the same connections) asynchronously; on another
        # stream the plan's sums would interleave with them on the wire and garble both.
        out = mx.distributed.all_sum(x, group=self._group, stream=generation_stream)
        mx.eval(out)
        return out

    def ping(self) -> None:
        self._sum(mx.array([_PING], dtype=mx.int64))

    def send(self, plan: StepPlan | None) -> None:
        if plan is None:
            self._sum(mx.array([_STOP], dtype=mx.int64))
            return
        # Slot actions carry a Trio reply event (not picklable); --distributed refuses
        # --slot-save-path, so there are none (a restore on rank 0 alone would desync).
        assert not plan.slot_actions
        data = pickle.dumps(plan)
        self._sum(mx.array([len(data)], dtype=mx.int64))
        self._sum(mx.array(np.frombuffer(data + bytes(-len(data) % 4), dtype=np.int32)))

    def receive(self) -> StepPlan | None:
        n = _PING
        while n == _PING:
            n = int(np.array(self._sum(mx.zeros((1,), dtype=mx.int64)))[0])
        if n == _STOP:
            return None
        words = self._sum(mx.zeros(((n + 3) // 4,), dtype=mx.int32))
        data = np.array(words).tobytes()[:n]
        plan = pickle.loads(data)  # noqa: S301 - from rank 0 of our own group
        assert isinstance(plan, StepPlan)
        return plan


class BroadcastingBackend:
    """Rank 0's backend: every plan goes to the other ranks, then to the local shard."""

    # The model runner calls ``heartbeat`` after this long without a plan.
    heartbeat_s = PING_S

    def __init__(self, inner: Backend, group: Any, deadline_s: float) -> None:
        self._inner = inner
        self._watchdog = Watchdog(deadline_s, drain=True)
        self._channel = PlanChannel(group, self._watchdog)
        self._lost = False
        self.info: ModelInfo = inner.info

    def apply(self, plan: StepPlan) -> StepOutput:
        try:
            self._channel.send(plan)
            with self._watchdog.watch("a step"):
                return self._inner.apply(plan)
        except RankLost as error:
            self._drain_then_raise(error)
        except RuntimeError as error:  # a collective inside the sharded forward pass
            self._drain_then_raise(RankLost(f"distributed: lost a rank during a step: {error}"))

    def heartbeat(self) -> None:
        try:
            self._channel.ping()
        except RankLost as error:
            self._drain_then_raise(error)

    def _drain_then_raise(self, error: RankLost) -> NoReturn:
        """A collective failed (a peer's connection closed): stop as on SIGTERM, so /health
        answers 503 and streams end, for ``Watchdog.DRAIN_S``; then fail the model runner,
        which ends the server with the error (exit status 1)."""
        self._lost = True
        lost.append(error)
        log.error("%s: stopping", error)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(Watchdog.DRAIN_S)
        raise error

    def close(self) -> None:
        try:
            if not self._lost:
                self._channel.send(None)
        finally:
            self._inner.close()


def follow(backend: Backend, group: Any, deadline_s: float) -> None:
    """A rank > 0: apply rank 0's plans to the local shard until rank 0 says stop (rank 0
    pings while idle, so a wait longer than the deadline means it is gone)."""
    watchdog = Watchdog(deadline_s)
    channel = PlanChannel(group, watchdog)
    steps = 0
    try:
        while (plan := channel.receive()) is not None:
            try:
                with watchdog.watch("a step"):
                    backend.apply(plan)
            except RuntimeError as error:
                raise RankLost(f"distributed: lost a rank during a step: {error}") from error
            steps += 1
    finally:
        backend.close()
    log.info("rank %d: rank 0 stopped after %d steps", group.rank(), steps)


def shard_model(model: Any) -> None:
    """Split the model's layers over the group (mlx-lm's tensor-parallel ``shard``)."""
    group = init_group()
    if not hasattr(model, "shard"):
        raise ModelError(f"--distributed: mlx-lm cannot shard {type(model).__module__} models")
    try:
        model.shard(group)
    except (ValueError, AssertionError) as error:
        why = f"--distributed: cannot split the model in {group.size()}: {error}"
        raise ModelError(why) from error
    mx.eval(model.parameters())
