"""Prompt lookup: drafts copied from where the sequence's latest n tokens occurred before."""

from __future__ import annotations


def propose_ngram(tokens: list[int], count: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to `count` drafts for the token after `tokens` (prompt + completion so far): for n
    from ngram_max down to ngram_min, the tokens that followed an earlier occurrence of the
    last n tokens: the latest occurrence followed by `count` tokens, else the one followed by
    the most (the latest among equals). [] when no suffix recurs (the step then decodes one
    token). Deterministic in `tokens` alone."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix, best = tokens[length - n :], []
        for start in range(length - n - 1, -1, -1):  # latest first; never the suffix itself
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + count]
                if len(follow) > len(best):
                    best = follow
                if len(best) == count:
                    break
        if best:
            return best
    return []
