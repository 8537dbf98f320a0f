"""`PromptStream`: the endless, deterministic sequence of a dataset's prompts.

Position p of the stream is row `order(epoch)[p % N]` with `epoch = p // N` (N rows):
each epoch visits every row once, in a shuffle seeded by (seed, epoch) only. A
position therefore names the same prompt in every run with that seed, resumed or
not, whatever consumed the positions before it. `take(position, count)` is the one
call a step makes for its next `count` prompts; the job keeps the position (a cursor
saved in checkpoints), so an algorithm that draws more prompts in some steps (DAPO's
filter_groups resampling) asks for more and the run stays reproducible.
"""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache

from rl_engine.data.records import PromptRecord
from rl_engine.data.tokenize import PromptDataset


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed of (seed, epoch), stable across Python versions and platforms."""
    digest = hashlib.blake2b(f"prompts/{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class PromptStream:
    """Records of `dataset` by stream position; shuffled per epoch unless `shuffle` is False."""

    def __init__(self, dataset: PromptDataset, *, seed: int, shuffle: bool = True):
        if len(dataset) == 0:
            raise ValueError("a PromptStream needs at least one prompt")
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self._order = lru_cache(maxsize=4)(self._epoch_order)

    def __len__(self) -> int:
        """Rows per epoch."""
        return len(self.dataset)

    def _epoch_order(self, epoch: int) -> tuple[int, ...]:
        rows = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(epoch_seed(self.seed, epoch)).shuffle(rows)
        return tuple(rows)

    def order(self, epoch: int) -> tuple[int, ...]:
        """Row indices of `epoch` in the order it visits them."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        return self._order(epoch)

    def rows(self, position: int, count: int) -> list[int]:
        """Row indices at stream positions [position, position + count)."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position must be an int >= 0, got {position!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        size = len(self.dataset)
        return [self.order(p // size)[p % size] for p in range(position, position + count)]

    def take(self, position: int, count: int) -> list[PromptRecord]:
        """The records at stream positions [position, position + count)."""
        return [self.dataset.records[i] for i in self.rows(position, count)]

    def epoch_of(self, position: int) -> int:
        return position // len(self.dataset)
