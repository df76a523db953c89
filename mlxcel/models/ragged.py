"""Decode attention over a left-padded batch cache, in groups of rows of similar length.

mlx-lm's ``BatchKVCache`` right-aligns every row's keys, so a row of 40 tokens beside one of
2,000 has 1,960 keys of padding, and a decode step reads them all: with 16 short rows and one
2,000-token row, attention read ~1.5 GB a step and the step went from ~105 to ~275 ms (one
layer's attention, 17 rows x 2,010 keys: 5.6 ms padded, 0.4 ms in two groups). Here the rows
are sorted by length and cut into a few groups where a cut saves more key reads than an extra
attention call costs; each group attends over the keys from its longest row's start, and the
mask (left padding, the causal part of a multi-token step) is sliced with them. Masked keys
weigh exactly zero, so a row's result is the same values summed over fewer zeros.

Only the plan is computed in Python, once per step (the layers of a step share their rows'
padding), and it is pure arithmetic on at most a few hundred integers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import attrs

from mlxcel.models.mlx_setup import mx

__all__ = ["MAX_QUERIES", "Group", "attend_grouped", "enabled", "plan"]

# ``MLXCEL_RAGGED=0`` reads the whole padded batch, as mlx-lm does (for comparisons).
enabled = os.environ.get("MLXCEL_RAGGED", "1") != "0"

# An extra group costs ~8 small ops (~150 us here); reading one row's keys and values for one
# key position (3 KV heads x 64 x 4 bytes x 2) costs ~0.2 us at this machine's ~8 GB/s: a cut
# must save more than this many key positions (summed over the rows it shortens) to pay.
OVERHEAD_KEYS = 1024
MAX_GROUPS = 4
# Decode steps (1 query token) and speculative verification (1 + the proposal width).
MAX_QUERIES = 32


@attrs.frozen
class Group:
    """Rows (batch indices, ascending) that attend over keys ``[start, kv_len)``."""

    rows: tuple[int, ...]
    start: int


def plan(pads: list[int], kv_len: int) -> tuple[Group, ...] | None:
    """How to group rows with these left paddings; None when one group (the whole padded
    batch) is cheapest."""
    if len(pads) < 2:
        return None
    global _last
    key = (tuple(pads), kv_len)
    last = _last
    if last is not None and last[0] == key:
        return last[1]
    result = _plan(pads, kv_len)
    _last = (key, result)  # one tuple, swapped whole: safe if two threads ask
    return result


# The last plan: a step's layers ask with the same rows and length.
_last: tuple[tuple[tuple[int, ...], int], tuple[Group, ...] | None] | None = None


def _plan(pads: list[int], kv_len: int) -> tuple[Group, ...] | None:
    order = sorted(range(len(pads)), key=lambda i: -pads[i])  # shortest rows first
    lengths = [kv_len - pads[i] for i in order]
    ranges = [(0, len(order))]
    while len(ranges) < MAX_GROUPS:
        best = None  # (saving, range index, cut)
        for r, (a, b) in enumerate(ranges):
            top = lengths[b - 1]
            for c in range(a + 1, b):
                # Rows a..c-1 stop reading up to the longest's length.
                saving = (c - a) * (top - lengths[c - 1])
                if best is None or saving > best[0]:
                    best = (saving, r, c)
        if best is None or best[0] <= OVERHEAD_KEYS:
            break
        _, r, c = best
        a, b = ranges[r]
        ranges[r : r + 1] = [(a, c), (c, b)]
    if len(ranges) == 1:
        return None
    groups = tuple(Group(tuple(sorted(order[a:b])), kv_len - lengths[b - 1]) for a, b in ranges)
    # What each group reads, in key positions (``_cost``), against the padded batch's: when
    # rows of similar length sit apart (row reuse puts a joining row wherever a hole was),
    # their groups are no longer runs of neighbours, and the cut may not pay any more.
    saved = len(pads) * kv_len - sum(_cost(g, kv_len) for g in groups)
    if saved <= OVERHEAD_KEYS * (len(groups) - 1):
        return None
    return groups


def _span(rows: tuple[int, ...]) -> int:
    return rows[-1] - rows[0] + 1


def _gathers(rows: tuple[int, ...]) -> bool:
    """Whether a group's rows are gathered (copied, then read: three passes over their keys)
    rather than read as the slice of neighbours that spans them (rows between computed for
    nothing, but no copy)."""
    return _span(rows) > 3 * len(rows)


def _cost(group: Group, kv_len: int) -> int:
    length = kv_len - group.start
    if _gathers(group.rows):
        return 3 * len(group.rows) * length
    return _span(group.rows) * length


def attend_grouped(
    groups: tuple[Group, ...],
    attend: Callable[..., mx.array],
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    mask: Any,
    **kwargs: Any,
) -> mx.array:
    """``attend`` (an SDPA with mlx's signature) run per group, rows back in batch order."""
    batch = queries.shape[0]
    outs = []
    for g in groups:
        rows, pick = _rows(g.rows)
        m = mask
        if isinstance(mask, mx.array):
            if mask.shape[0] == batch and batch > 1:
                m = m[rows]
            m = m[..., g.start :]
        # "causal" and None stay: the queries are the last positions, aligned bottom-right.
        out = attend(
            queries[rows],
            keys[rows, :, g.start :],
            values[rows, :, g.start :],
            mask=m,
            **kwargs,
        )
        outs.append(out if pick is None else out[pick])
    out = mx.concatenate(outs, axis=0)
    order = [i for g in groups for i in g.rows]
    if order == list(range(batch)):
        return out
    inverse = [0] * batch
    for pos, i in enumerate(order):
        inverse[i] = pos
    return out[mx.array(inverse)]


def _rows(rows: tuple[int, ...]) -> tuple[slice | mx.array, mx.array | None]:
    """How a group reads its rows: a slice of neighbours (a view, no copy), with the group's
    own rows picked out of its result when the slice spans others; or, when the rows are
    too far apart for that to pay, an index array (a gather)."""
    if _gathers(rows):
        return mx.array(rows), None
    span = slice(rows[0], rows[-1] + 1)
    if _span(rows) == len(rows):
        return span, None
    return span, mx.array([r - rows[0] for r in rows])
