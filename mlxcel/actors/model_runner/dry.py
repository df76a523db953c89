"""DRY ("Don't Repeat Yourself") repetition penalty with llama.cpp's semantics (compute thread).

For every earlier position whose preceding tokens repeat the end of the context for at least
``allowed_length`` tokens, the token that followed it there would extend the repetition; it gets
``multiplier * base ** (length - allowed_length)`` subtracted from its logit, ``length`` being the
longest such repeat (llama.cpp ``llama_sampler_dry_apply``). A sequence breaker (a string the
tokenizer turns into a head token plus a tail) caps the repeat length at the number of tokens
after the last breaker in the window, and a single-token breaker is never penalised itself.

llama.cpp finds suffix matches with a reversed Z-algorithm in O(N) scalar steps. That needs the
tokens on the host, which would force a sync on the token sampled by the previous step and
break mlx-lm's pipelining for the whole batch. Instead the match lengths are computed on the
device as an [R, N] comparison table (N = window, R = the longest length that still changes the
penalty: the exponent saturates at ``88.72 / ln(base)`` just as in llama.cpp). Cost per step:
O(N * R) elementwise work plus O(V) for the scatter, no host round trip. With the llama-server
defaults (window 64, base 1.75) that is 64 x 63 comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import mlx.core as mx

Processor = Callable[[mx.array, mx.array], mx.array]

# llama.cpp clamps breakers before tokenising them (MAX_CHAR_LEN, MAX_SEQ_LEN in llama-sampling).
_MAX_BREAKER_CHARS = 40
_MAX_TAIL_TOKENS = 20
_FLOAT_MAX_LOG = 88.7228391


@attrs.frozen
class Breakers:
    """Sequence breakers as token ids: single-token heads, and (head, tail) multi-token ones."""

    single: frozenset[int] = frozenset()
    multi: frozenset[tuple[int, tuple[int, ...]]] = frozenset()


def breakers_from_strings(
    strings: Sequence[str],
    *,
    encode: Callable[[str], list[int]],
    token_texts: Sequence[str] | None = None,
) -> Breakers:
    """Map breaker strings to token sequences.

    ``encode`` must not add special tokens. With ``token_texts`` (the text of each token id, as
    the tokenizer decodes it alone) this follows llama.cpp exactly: every token that contains the
    breaker is a single-token breaker, and every token ending in a prefix of it is a head whose
    tail is the encoding of the rest. That is an O(V) scan per breaker, so callers should cache
    the result per model and breaker set. Without ``token_texts`` only ``encode(breaker)`` itself
    is used (a head and its tail), which misses tokens that merely contain the breaker.
    """
    single: set[int] = set()
    multi: set[tuple[int, tuple[int, ...]]] = set()
    for raw in strings:
        text = raw[:_MAX_BREAKER_CHARS]
        if not text:
            continue
        if token_texts is None:
            ids = encode(text)
            if not ids:
                continue
            tail = tuple(ids[1 : 1 + _MAX_TAIL_TOKENS])
            if tail:
                multi.add((ids[0], tail))
            else:
                single.add(ids[0])
            continue
        for tid, word in enumerate(token_texts):
            if text in word:
                single.add(tid)
                continue
            # A suffix of the token that is a proper prefix of the breaker starts a sequence.
            pos = word.find(text[0])
            while pos != -1:
                rest = word[pos:]
                if text.startswith(rest):
                    tail = tuple(encode(text[len(rest) :])[:_MAX_TAIL_TOKENS])
                    multi.add((tid, tail))
                pos = word.find(text[0], pos + 1)
    return Breakers(single=frozenset(single), multi=frozenset(multi))


def _repeat_cap(base: float, allowed_length: int, window: int) -> int:
    """The longest repeat length worth measuring: past it the penalty no longer grows."""
    longest = window - 1
    if base == 1.0:
        return max(1, min(longest, allowed_length))
    if base > 1.000001:
        max_exponent = int(_FLOAT_MAX_LOG / math.log(base))
        return max(1, min(longest, allowed_length + max_exponent))
    return max(1, longest)


def make_dry(
    *,
    multiplier: float,
    base: float,
    allowed_length: int,
    penalty_last_n: int,
    breakers: Breakers,
    vocab_size: int,
) -> Processor | None:
    """A logits processor for DRY, or None when these settings disable it (as llama.cpp does).

    ``penalty_last_n`` -1 means the whole context, 0 disables.
    """
    if multiplier == 0.0 or base < 1.0 or penalty_last_n == 0:
        return None
    max_exponent = int(_FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    single_mask = None
    if breakers.single:
        single_mask = mx.zeros((vocab_size,), dtype=mx.bool_)
        single_mask[mx.array(sorted(breakers.single), dtype=mx.int32)] = True
    # Group multi-token breakers by tail so each tail is compared once.
    by_tail: dict[tuple[int, ...], list[int]] = {}
    for head, tail in sorted(breakers.multi):
        by_tail.setdefault(tail, []).append(head)
    tails = [(mx.array(heads, dtype=mx.int32), tail) for tail, heads in by_tail.items()]

    def dry(tokens: mx.array, logits: mx.array) -> mx.array:
        total = tokens.shape[0]
        n = total if penalty_last_n < 0 else min(total, penalty_last_n)
        if n <= allowed_length or n < 2:
            return logits
        s = tokens[total - n :][::-1]  # s[j] is the j-th token from the end
        pos = mx.arange(n)

        # Step 1: the repeat limit from the last breaker (llama.cpp's rep_limit).
        matched = mx.full((n,), -1, dtype=mx.int32)
        if single_mask is not None:
            matched = mx.where(single_mask[s], 0, matched)
        for heads, tail in tails:
            size = len(tail)
            ok = (s[:, None] == heads[None, :]).any(axis=1) & (pos >= size)
            for offset, tok in enumerate(tail):
                ok = ok & (s[mx.clip(pos - 1 - offset, 0, n - 1)] == tok)
            matched = mx.where(ok, mx.maximum(matched, size), matched)
        found = matched >= 0
        first = mx.argmax(found)
        rep_limit = mx.where(found.any(), first.astype(mx.int32) - matched[first], n)

        # Step 2: z[k] = how far the sequence ending k tokens back matches the context's end.
        cap = _repeat_cap(base, allowed_length, n)
        j = mx.arange(cap)[:, None]
        k = mx.arange(1, n)[None, :]
        idx = j + k
        equal = (s[j] == s[mx.minimum(idx, n - 1)]) & (idx < n)
        z = mx.cumprod(equal.astype(mx.int32), axis=0).sum(axis=0)
        length = mx.minimum(z, rep_limit)

        # Steps 3 and 4: penalise the token that followed each long enough match.
        exponent = length - allowed_length
        if max_exponent > 0:
            exponent = mx.minimum(exponent, max_exponent)
        penalty = multiplier * mx.power(
            mx.array(base, dtype=mx.float32), exponent.astype(mx.float32)
        )
        penalty = mx.where(length >= allowed_length, penalty, 0.0)
        # The max penalty per token, read back at the candidate positions only: a token that
        # follows several matches gets the same (largest) value written each time.
        nexts = s[: n - 1]
        best = mx.zeros((logits.shape[-1],), dtype=mx.float32).at[nexts].maximum(penalty)[nexts]
        if single_mask is not None:
            best = mx.where(single_mask[nexts], 0.0, best)
        out = mx.array(logits)
        out[:, nexts] = logits[:, nexts] - best.astype(logits.dtype)
        return out

    return dry
