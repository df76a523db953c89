"""Prometheus metrics: llama-server's `llamacpp:` families first, then `mlxcel_` ones.

Counters and histograms are updated where the events happen (the scheduler per step, the
streamer per token); gauges and the prompt-cache counters are read from a frozen snapshot of
the scheduler taken at scrape time, so a scrape never waits for the compute thread. Each
server has its own registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mlxcel.runtime.messages import (
    AudioWorkerStatistics,
    RealtimeStatistics,
    SchedulerStatistics,
)

# llama-server exposes no `_created` series; scrapers comparing the two should see the same set.
disable_created_metrics()

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_WAIT_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class _Live(Collector):
    """Families computed at scrape time from callbacks into the running system."""

    def __init__(self) -> None:
        # Frozen snapshots, taken at scrape time (the scheduler's ``statistics``).
        self.scheduler: Callable[[], SchedulerStatistics] = SchedulerStatistics
        self.queued: Callable[[], int] = lambda: 0
        self.blas_threads: Callable[[], int | None] = lambda: None
        # HTTP requests being served (this scrape included): what the shutdown drain waits on.
        self.in_flight: Callable[[], int] = lambda: 0
        # Per side worker (embedding, rerank): jobs (queued, being computed).
        self.side_jobs: Callable[[], dict[str, tuple[int, int]]] = dict
        # Per speech worker (speech-to-text, text-to-speech): its queue now.
        self.audio_jobs: Callable[[], dict[str, AudioWorkerStatistics]] = dict
        # Realtime voice sessions now; None without audio.
        self.realtime_sessions: Callable[[], RealtimeStatistics | None] = lambda: None
        # Router mode: loads per model since start (empty with one model).
        self.model_loads: Callable[[], dict[str, int]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.scheduler()
        yield GaugeMetricFamily(
            "llamacpp:requests_processing", "Number of requests processing.", value=stats.running
        )
        yield GaugeMetricFamily(
            "llamacpp:requests_deferred", "Number of requests deferred.", value=stats.waiting
        )
        yield GaugeMetricFamily(
            "mlxcel_queue_depth", "Requests admitted and waiting for a slot.", value=self.queued()
        )
        yield GaugeMetricFamily(
            "mlxcel_http_requests_in_flight",
            "HTTP requests being served, every route (this scrape included).",
            value=self.in_flight(),
        )
        side = GaugeMetricFamily(
            "mlxcel_side_jobs",
            "Embedding and rerank jobs per worker, waiting (queued) or being computed (running).",
            labels=["worker", "state"],
        )
        for worker, (queued, running) in sorted(self.side_jobs().items()):
            side.add_metric([worker, "queued"], queued)
            side.add_metric([worker, "running"], running)
        yield side
        audio = GaugeMetricFamily(
            "mlxcel_audio_jobs",
            "Speech worker jobs: held (admitted, queued on the worker or computed; at most "
            "--audio-queue-depth) and waiting (live voice turns in line for a place).",
            labels=["worker", "state"],
        )
        refused = CounterMetricFamily(
            "mlxcel_audio_refused",
            "HTTP audio requests refused with 503 because the worker's queue was full.",
            labels=["worker"],
        )
        for worker, w in sorted(self.audio_jobs().items()):
            audio.add_metric([worker, "held"], w.held)
            audio.add_metric([worker, "waiting"], w.waiting)
            refused.add_metric([worker], w.refused)
        yield audio
        yield refused
        if (sessions := self.realtime_sessions()) is not None:
            yield from _realtime(sessions)
        if loads := self.model_loads():
            loaded = CounterMetricFamily(
                "mlxcel_model_loads",
                "Router mode: loads of each model since start (--models-max makes room by "
                "unloading the least recently used idle one).",
                labels=["model"],
            )
            for name, count in sorted(loads.items()):
                loaded.add_metric([name], count)
            yield loaded
        yield GaugeMetricFamily(
            "mlxcel_batch_size",
            "Sequences (rows: one per choice) in the running batch.",
            value=stats.rows,
        )
        if (threads := self.blas_threads()) is not None:
            yield GaugeMetricFamily(
                "mlxcel_blas_threads",
                "OpenBLAS threads per CPU matmul now (halved while realtime voice sessions are "
                "open; on a GPU the model's matmuls use none).",
                value=threads,
            )
        s = stats.cache
        yield CounterMetricFamily(
            "mlxcel_prompt_cache_hits", "Prompt-cache lookups that reused KV.", value=s.hits
        )
        yield CounterMetricFamily(
            "mlxcel_prompt_cache_misses", "Prompt-cache lookups that found nothing.", value=s.misses
        )
        yield CounterMetricFamily(
            "mlxcel_prompt_cache_evictions", "Prompt-cache entries evicted.", value=s.evictions
        )
        yield GaugeMetricFamily(
            "mlxcel_prompt_cache_bytes", "Bytes held by the prompt cache.", value=s.nbytes
        )
        yield CounterMetricFamily(
            "mlxcel_vision_cache_hits",
            "Images whose encoding came from the vision cache (vision models).",
            value=s.vision_hits,
        )
        yield CounterMetricFamily(
            "mlxcel_vision_cache_misses",
            "Images the vision tower encoded (vision models).",
            value=s.vision_misses,
        )
        yield GaugeMetricFamily(
            "mlxcel_prompt_cache_entries", "Entries in the prompt cache.", value=s.entries
        )
        yield GaugeMetricFamily(
            "mlxcel_mlx_active_bytes",
            "Bytes in live mlx arrays (weights, batch KV, prompt cache).",
            value=s.mlx_active,
        )
        yield GaugeMetricFamily(
            "mlxcel_mlx_cache_bytes",
            "Freed buffers mlx's allocator keeps for reuse (bounded by --mlx-cache-limit).",
            value=s.mlx_cached,
        )


def _realtime(sessions: RealtimeStatistics) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    yield GaugeMetricFamily(
        "mlxcel_realtime_sessions_open",
        "Realtime voice sessions open (/v1/realtime WebSockets admitted).",
        value=sessions.open,
    )
    yield GaugeMetricFamily(
        "mlxcel_realtime_sessions_limit",
        "Realtime voice sessions admitted at most (--realtime-max-sessions, else the "
        "capacity); more are refused at open with server_busy (close 1013).",
        value=sessions.limit,
    )
    yield GaugeMetricFamily(
        "mlxcel_realtime_sessions_capacity",
        "Realtime voice sessions this server serves at real-time pace: min(--parallel, "
        "--audio-queue-depth), one decode row and one place at each speech worker a session. "
        "A limit above it was warned about at start.",
        value=sessions.capacity,
    )
    held = GaugeMetricFamily(
        "mlxcel_realtime_buffered_bytes",
        "Bytes the open realtime sessions hold for their clients: uncommitted input audio "
        "(direction=input; at most 120 s a session) and outgoing events not yet taken by the "
        "client (direction=output; at most 8 MiB a session).",
        labels=["direction"],
    )
    held.add_metric(["input"], sessions.input_bytes)
    held.add_metric(["output"], sessions.output_bytes)
    yield held
    dropped = CounterMetricFamily(
        "mlxcel_realtime_dropped_sessions",
        "Realtime sessions the server ended because their client did not read: its outgoing "
        "queue overflowed (reason=outgoing_backlog, close 1008) or a send waited longer than "
        "--realtime-send-timeout-secs (reason=send_timeout, connection dropped).",
        labels=["reason"],
    )
    counts = dict(sessions.dropped)
    for reason in ("outgoing_backlog", "send_timeout"):
        dropped.add_metric([reason], counts.get(reason, 0))
    yield dropped


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # process_resident_memory_bytes and friends: what an operator watches for leaks.
        ProcessCollector(registry=r)
        self.prompt_tokens = Counter(
            "llamacpp:prompt_tokens", "Number of prompt tokens processed.", registry=r
        )
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt process time.", registry=r)
        self.prompt_tokens_cache = Counter(
            "llamacpp:prompt_tokens_cache",
            "Number of prompt tokens reused from the prompt cache.",
            registry=r,
        )
        self.prompt_cache_hit_ratio = Gauge(
            "llamacpp:prompt_cache_hit_ratio",
            "Share of prompt tokens reused from the prompt cache.",
            registry=r,
        )
        self.tokens_predicted = Counter(
            "llamacpp:tokens_predicted", "Number of generation tokens processed.", registry=r
        )
        self.tokens_predicted_seconds = Counter(
            "llamacpp:tokens_predicted_seconds", "Predict process time.", registry=r
        )
        self.n_decode = Counter(
            "llamacpp:n_decode", "Total number of model steps (decode calls).", registry=r
        )
        self.n_busy_slots_per_decode = Gauge(
            "llamacpp:n_busy_slots_per_decode", "Average number of busy slots per step.", registry=r
        )
        self.prompt_tokens_seconds = Gauge(
            "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.", registry=r
        )
        self.predicted_tokens_seconds = Gauge(
            "llamacpp:predicted_tokens_seconds",
            "Average generation throughput in tokens/s.",
            registry=r,
        )
        self.live = _Live()
        r.register(self.live)
        self.steps = Counter("mlxcel_steps", "Model steps by kind.", ["kind"], registry=r)
        self.prefill_tokens = Counter(
            "mlxcel_prefill_tokens", "Prompt tokens prefilled (not from cache).", registry=r
        )
        self.decode_tokens = Counter("mlxcel_decode_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "mlxcel_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.spec_proposed = Counter(
            "mlxcel_spec_proposed_tokens",
            "Tokens proposed by speculation, by proposer.",
            ["proposer"],
            registry=r,
        )
        self.spec_accepted = Counter(
            "mlxcel_spec_accepted_tokens",
            "Proposed tokens the model accepted, by proposer.",
            ["proposer"],
            registry=r,
        )
        self.aborts = Counter(
            "mlxcel_aborts", "Requests abandoned by their client before finishing.", registry=r
        )
        self.ttft = Histogram(
            "mlxcel_time_to_first_token_seconds",
            "Submit to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "mlxcel_inter_token_seconds",
            "Gap between a request's tokens.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.audio_wait = Histogram(
            "mlxcel_audio_wait_seconds",
            "How long a live voice turn waited for a place at a speech worker (0: one was free).",
            ["worker"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        # Running sums behind the average gauges (prometheus counters are write-only).
        self._steps = 0
        self._busy = 0
        self._prompt = [0, 0.0]
        self._cached = 0
        self._decode = [0, 0.0]

    def record_cached(self, n: int) -> None:
        """A request joined the batch with ``n`` prompt tokens taken from the prompt cache."""
        self._cached += n
        self.prompt_tokens_cache.inc(n)
        self._hit_ratio()

    def _hit_ratio(self) -> None:
        total = self._cached + self._prompt[0]
        self.prompt_cache_hit_ratio.set(self._cached / total if total else 0.0)

    def record_audio_wait(self, worker: str, seconds: float) -> None:
        """A live voice turn got its place at ``worker`` after ``seconds`` in line."""
        self.audio_wait.labels(worker).observe(seconds)

    def record_drafts(self, proposer: str, proposed: int, accepted: int) -> None:
        self.spec_proposed.labels(proposer).inc(proposed)
        self.spec_accepted.labels(proposer).inc(accepted)

    def record_step(self, *, seconds: float, busy: int, prefill: int, decoded: int) -> None:
        """One model step: its wall time goes to prompt processing if it read prompt tokens."""
        self.n_decode.inc()
        self._steps += 1
        self._busy += busy
        self.n_busy_slots_per_decode.set(self._busy / self._steps)
        if prefill:
            self.steps.labels("prefill").inc()
            self.prompt_tokens.inc(prefill)
            self.prefill_tokens.inc(prefill)
            self.prompt_seconds.inc(seconds)
            self._prompt[0] += prefill
            self._prompt[1] += seconds
            self.prompt_tokens_seconds.set(self._prompt[0] / self._prompt[1])
            self._hit_ratio()
        else:
            self.steps.labels("decode").inc()
            self.tokens_predicted_seconds.inc(seconds)
            self._decode[1] += seconds
        if decoded:
            self.tokens_predicted.inc(decoded)
            self.decode_tokens.inc(decoded)
            self._decode[0] += decoded
            if self._decode[1]:
                self.predicted_tokens_seconds.set(self._decode[0] / self._decode[1])

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
