"""The n-gram loop breaker (vLLM's repetition detection: ``max_pattern_size``,
``min_pattern_size``, ``min_count``): an answer whose last tokens are one pattern of 1..N tokens
said ``min_count`` times in a row is stopped there, as small models stuck in a loop otherwise
run to ``max_tokens``.

Pure token bookkeeping for the streamer, one detector per choice.
"""

from __future__ import annotations

from collections import deque

from mlxcel.runtime.messages import LoopLimit


class LoopDetector:
    def __init__(self, limit: LoopLimit) -> None:
        self._limit = limit
        # Enough to hold the longest pattern repeated min_count times.
        self._tail: deque[int] = deque(maxlen=limit.max_size * limit.min_count)

    def feed(self, token: int) -> bool:
        """Add one generated token; True when the output now ends in a loop."""
        tail = self._tail
        tail.append(token)
        count = self._limit.min_count
        n = len(tail)
        window: list[int] | None = None  # the tail as a list, made once a size gets past the check
        for size in range(self._limit.min_size, self._limit.max_size + 1):
            if size * count > n:
                break
            # Cheap rejection first (every token pays it): a loop repeats the last token.
            if tail[-1] != tail[-1 - size]:
                continue
            if window is None:
                window = list(tail)
            pattern = window[n - size :]
            if all(window[n - (k + 1) * size : n - k * size] == pattern for k in range(1, count)):
                return True
        return False
