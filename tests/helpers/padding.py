"""Token sequences, padded on either side and unpadded again (the patching tests' layouts)."""

from __future__ import annotations

import torch


def random_sequences(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def pad_sequences(seqs, side, pad_id=0):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


def unpad_logprobs(logps, seqs, side):
    """Each sequence's own (len-1) logprobs out of a padded (B, T-1) result."""
    width = logps.shape[1] + 1
    out = []
    for i, s in enumerate(seqs):
        start = width - len(s) if side == "left" else 0
        out.append(logps[i, start : start + len(s) - 1])
    return out
