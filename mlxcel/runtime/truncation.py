"""Which of a conversation's items the model reads: OpenAI's ``truncation``.

Realtime sessions use all of this; the Responses API's ``truncation: "auto"`` uses
``first_kept`` (whole turns, just enough to fit). A voice conversation only grows. Past its
token budget the oldest items leave the model's context (they stay in the conversation).
The cut is *sticky*: it moves only when the budget is exceeded again, so between cuts every
turn's prompt starts the same way and the prompt cache serves all but the new turn.
``retention_ratio`` cuts deeper than needed (0.8: down to 80 % of the budget) so that cuts,
each a cache miss, come less often.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

__all__ = ["Truncation", "budget", "first_kept"]


@attrs.frozen
class Truncation:
    """``"auto"`` is ``Truncation()``: cut just enough, within the context window."""

    retention_ratio: float = 1.0
    # Cap on the conversation's tokens after the instructions (token_limits.post_instructions).
    post_instructions: int | None = None


def budget(
    truncation: Truncation, *, context: int, instructions: int, max_output: int | None
) -> int:
    """Tokens the conversation may take: the context window less the instructions and the
    answer's room (a quarter of the window when the answer has no cap), and at most
    ``post_instructions``."""
    room = max_output if max_output is not None else context // 4
    limit = context - instructions - min(room, context // 2)
    if truncation.post_instructions is not None:
        limit = min(limit, truncation.post_instructions)
    return max(limit, 0)


def first_kept(
    n_items: int, start: int, tokens_from: Callable[[int], int], limit: int, ratio: float
) -> int:
    """The first item the model reads, given the current one (``start``).

    ``tokens_from(k)`` is the conversation's tokens when it starts at item ``k``; it shrinks
    as ``k`` grows. Under ``limit`` nothing moves. Over it, the cut moves to the first item
    from which the rest fits in ``ratio * limit``; the newest item is always kept (if it
    alone is too long, the answer fails as a too-long prompt would).
    """
    if n_items == 0 or tokens_from(start) <= limit:
        return start
    target = int(ratio * limit)
    low, high = min(start + 1, n_items - 1), n_items - 1  # tokens_from is monotone
    while low < high:
        mid = (low + high) // 2
        if tokens_from(mid) <= target:
            high = mid
        else:
            low = mid + 1
    return low
