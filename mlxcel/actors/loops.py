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
        for size in range(self._limit.min_size, self._limit.max_size + 1):
            span = size * count
            if span > n:
                break
            # Cheap rejection first: a loop of this size repeats the last token size back.
            if tail[-1] != tail[-1 - size]:
                continue
            window = list(tail)[n - span :]
            pattern = window[-size:]
            if all(window[i * size : (i + 1) * size] == pattern for i in range(count - 1)):
                return True
        return False
