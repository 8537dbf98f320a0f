"""The receiving side of a weight sync: pieces land in place in the receiver's own tensors.

`WeightReceiver(targets, manifest, plan, receiver, bucket_bytes)` checks once,
before any sync, that the senders' manifest and this receiver's plan fit its
tensors (every name, shape and dtype; every target covered): a ValueError
names the first key that does not, and nothing is written. `receive(channel)`
then runs one sync:

1. the header from sender 0: (magic, weight version, digest of manifest and
   plan, pieces for this receiver), checked before a byte is written: a
   sync built from another manifest or plan is refused (a mismatched receive
   size would abort the process inside gloo);
2. bucket by bucket, every piece received straight into a view of its target
   (`weight_pieces`: each piece is one contiguous range of the target);
3. tied names that are separate tensors here get a copy of the first one.

The caller publishes the returned version only after `receive` returned: a
sync that fails part way leaves the tensors torn, and the engine refuses to
generate until a complete one has arrived (`RolloutEngine.receive_weights`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from rl_engine.base.memory_pages import release_pages
from rl_engine.rollout.weight_pieces import plan_pieces, target_view
from rl_engine.rollout.weight_plan import (
    PointToPoint,
    WeightManifest,
    WeightPlan,
    dtype_name,
    sync_digest,
)

logger = logging.getLogger(__name__)

HEADER_MAGIC = 0x52574753  # "RWGS"
HEADER_SIZE = 4  # int64: magic, version, digest, number of pieces for this receiver
HEADER_TAG = 0x7FFF_0000  # above every piece index a sync can have


@dataclass(frozen=True, slots=True)
class SyncHeader:
    """What sender 0 tells each receiver before the data of a sync."""

    version: int
    digest: int
    pieces: int

    def encode(self) -> torch.Tensor:
        return torch.tensor(
            [HEADER_MAGIC, self.version, self.digest, self.pieces], dtype=torch.int64
        )

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> SyncHeader:
        magic, version, digest, pieces = (int(v) for v in tensor.tolist())
        if magic != HEADER_MAGIC:
            raise ValueError(f"weight sync header has magic {magic:#x}, expected {HEADER_MAGIC:#x}")
        return cls(version, digest, pieces)


class WeightReceiver:
    """One receiver's side of the weight group: validated once, then `receive` per sync."""

    def __init__(
        self,
        targets: Mapping[str, torch.Tensor],
        manifest: WeightManifest,
        plan: WeightPlan,
        receiver: int,
        bucket_bytes: int,
    ):
        """targets: every tensor this receiver holds, by name (a state dict with keep_vars:
        tied names may share one tensor); receiver: its index among the sync's receivers
        (its group rank minus manifest.num_senders)."""
        plan.check(manifest)
        self.manifest, self.plan, self.receiver = manifest, plan, receiver
        self.digest = sync_digest(manifest, plan, bucket_bytes)
        self._entries = _match_targets(targets, manifest, plan)
        self._buckets = plan_pieces(manifest, plan, receiver, bucket_bytes)
        self.nbytes = sum(
            p.numel * manifest.tensors[p.tensor].torch_dtype.itemsize
            for bucket in self._buckets
            for p in bucket
        )

    @property
    def num_pieces(self) -> int:
        return sum(len(b) for b in self._buckets)

    def receive(
        self,
        channel: PointToPoint,
        on_bucket: Callable[[int, int], None] | None = None,
        on_header: Callable[[int], None] | None = None,
    ) -> int:
        """Receive one sync in place; returns its weight version (the caller publishes it).

        on_header(version) runs once the header is checked, before any write;
        on_bucket(version, bucket) after each bucket has landed.
        """
        started = time.perf_counter()
        header_tensor = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        channel.recv([header_tensor], 0, HEADER_TAG).wait()
        header = SyncHeader.decode(header_tensor)
        if header.digest != self.digest or header.pieces != self.num_pieces:
            raise ValueError(
                f"weight sync to version {header.version}: the senders' manifest or plan "
                f"(digest {header.digest}, {header.pieces} pieces) is not the one this receiver "
                f"validated (digest {self.digest}, {self.num_pieces} pieces); reconnect the group"
            )
        if on_header is not None:
            on_header(header.version)
        with torch.no_grad():
            for number, bucket in enumerate(self._buckets):
                works = []
                for p in bucket:  # a peer gone can fail the posting as well as the wait
                    with named_failure(self._receiving(header.version, p)):
                        works.append(
                            channel.recv(
                                [target_view(self._entries[p.tensor][0], p)], p.sender, p.index
                            )
                        )
                for piece, work in zip(bucket, works):
                    wait_for(work, self._receiving(header.version, piece))
                if on_bucket is not None:
                    on_bucket(header.version, number)
            for first, *others in self._entries.values():
                for other in others:
                    other.copy_(first)
        logger.info(
            "received weight version %d: %d pieces, %.1f MiB in %.2f s",
            header.version,
            self.num_pieces,
            self.nbytes / 2**20,
            time.perf_counter() - started,
        )
        return header.version

    def _receiving(self, version: int, piece) -> str:
        """What a receive of `piece` is, for its error: the version, the tensor, the sender."""
        name = self.manifest.tensors[piece.tensor].name
        return f"weight sync to version {version}: receiving {name!r} from sender {piece.sender}"

    def release_targets(self) -> int:
        """Hand the pages of every tensor a sync writes back to the OS until the next sync
        refills them (`RolloutEngine.release_weights`); returns the bytes released. Raises
        WeightReleaseError naming the first tensor the sync would not write whole (its
        released bytes would be read), before releasing any."""
        ranges: dict[int, list[tuple[int, int]]] = {t: [] for t in self._entries}
        for bucket in self._buckets:
            for piece in bucket:
                ranges[piece.tensor].append((piece.start, piece.stop))
        for t, targets in self._entries.items():
            if not _tiles(sorted(ranges[t]), targets[0].numel()):
                raise WeightReleaseError(
                    f"{self.manifest.tensors[t].name!r}: a sync does not write every element "
                    "of it; the engine's weights cannot be released between syncs"
                )
        return sum(
            release_pages(tensor, self.manifest.tensors[t].name)
            for t, targets in self._entries.items()
            for tensor in targets
        )


class WeightReleaseError(RuntimeError):
    """An engine's weights cannot be released: a sync would not rewrite them whole."""


def _tiles(ranges: list[tuple[int, int]], numel: int) -> bool:
    """True when the sorted [start, stop) `ranges` cover [0, numel) once, without gaps."""
    end = 0
    for start, stop in ranges:
        if start != end:
            return False
        end = stop
    return end == numel


def wait_for(work, what: str) -> None:
    """Wait for a send or receive; its failure (a peer gone, a timeout) says what it was."""
    with named_failure(what):
        work.wait()


@contextlib.contextmanager
def named_failure(what: str):
    """A collective's RuntimeError (gloo's 'Connection closed by peer', a timeout) re-raised as
    '<what>: <the error's first sentence>', without the C++ source location."""
    try:
        yield
    except RuntimeError as err:
        detail = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\] ", "", " ".join(str(err).split()))
        raise RuntimeError(f"{what}: {detail.split(' This is typically')[0]}") from None


def _match_targets(
    targets: Mapping[str, torch.Tensor], manifest: WeightManifest, plan: WeightPlan
) -> dict[int, list[torch.Tensor]]:
    """manifest index -> [the tensor to receive into, other distinct tensors of its names];
    ValueError naming the first key that does not fit (nothing is written)."""
    by_name = manifest.by_name()
    for name in targets:
        if name not in by_name:
            raise ValueError(
                f"the receiver has tensor {name!r}, which the senders' manifest does not list"
            )
    entries: dict[int, list[torch.Tensor]] = {}
    covered: set[int] = set()
    for index, spec in enumerate(manifest.tensors):
        if spec.name not in plan.slices:
            continue
        present = [n for n in spec.names if n in targets]
        if not present:
            raise ValueError(f"the senders' manifest lists {spec.name!r}, which the receiver lacks")
        shape = plan.target_shape(spec)
        distinct: list[torch.Tensor] = []
        for name in present:
            tensor = targets[name]
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name!r}: the receiver holds shape {tuple(tensor.shape)}, the plan sends {shape}"
                )
            if tensor.dtype != spec.torch_dtype:
                raise ValueError(
                    f"{name!r}: the receiver holds {dtype_name(tensor.dtype)}, the senders send "
                    f"{spec.dtype} (bytes are received in place: the dtypes must agree)"
                )
            if not tensor.is_contiguous():
                raise ValueError(f"{name!r}: the receiver's tensor is not contiguous")
            if all(tensor is not t for t in distinct):
                distinct.append(tensor)
            covered.add(id(tensor))
        entries[index] = distinct
    missing = [name for name, tensor in targets.items() if id(tensor) not in covered]
    if missing:
        raise ValueError(f"the sync does not send {missing[0]!r}, which the receiver holds")
    return entries
