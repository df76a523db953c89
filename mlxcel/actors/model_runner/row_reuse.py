"""Row reuse: a finished row leaves a hole in the generation batch, and the next row to join
takes its place, so neither copies the rest of the batch's KV cache.

mlx-lm's ``GenerationBatch.filter`` gathers the kept rows of every layer's cache into new
buffers, and ``extend`` concatenates the joining rows onto them: each copies the whole batch.
At 64 rows of ~120 tokens on SmolLM2-135M that is ~755 MB per copy, ~40 ms per leave and
~70 ms per join on this CPU (docs/performance.md, "Where 64 streams lose time"), and under a
steady load there is about one of each per step, a third of the step. mlx cannot shrink a
buffer in place either: a batch made smaller by slicing is copied whole on its next write.

So, with enough rows decoding, a finished row stays in the batch as a hole: it keeps its place
in every list and cache, is computed with the others (one row's share of a step, ~2 ms at 64
rows) and reports nothing. A joining row whose tokens fit left of the batch's write position
(the usual case: a new prompt is shorter than the rows already decoding) is written into a
hole in place, one row's keys and values per layer. The batch is compacted the old way (one
copy) when holes would pass a quarter of its rows, when few rows are left, or when every live
row's keys start far enough right that trimming the common left padding pays for the copy.
"""

from __future__ import annotations

import os

# Below this many live rows a copy is cheap and a hole's share of each step is not.
MIN_ROWS = 8
# At most this fraction of the batch's rows may be holes.
MAX_HOLE_SHARE = 0.25
# Compact when every live row has at least this much left padding: mlx-lm's filter trims it,
# and without trims the buffer would only grow while rows come and go (the cache grows in
# 256-position steps, so less than one step is not worth a copy).
TRIM_PADDING = 256

# ``MLXCEL_ROW_REUSE=0`` copies on every join and leave, as mlx-lm does (for comparisons).
enabled = os.environ.get("MLXCEL_ROW_REUSE", "1") != "0"


def may_leave_holes(
    *, reusable: bool, physical: int, holes: int, live: int, ended: int, live_padding: int
) -> bool:
    """Whether ``ended`` rows may stay as holes (else the batch is compacted now).

    ``physical``: the batch's rows, holes included; ``holes``: holes already there; ``live``:
    rows still decoding after this; ``live_padding``: the least left padding among those."""
    if not (enabled and reusable) or live < MIN_ROWS:
        return False
    if holes + ended > physical * MAX_HOLE_SHARE:
        return False
    return live_padding < TRIM_PADDING
