"""The worker's errors: `BatchError` (bad data, raised on every rank) and `ParityError`."""

from __future__ import annotations


class BatchError(ValueError):
    """A step's batch was rejected before any forward; raised on every rank with the same message.

    `ranks` lists the ranks whose batch was bad (empty when the batch as a whole is bad).
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self):  # Ray pickles exceptions between processes
        return (_rebuild_batch_error, (str(self), self.ranks))


def _rebuild_batch_error(message: str, ranks: tuple[int, ...]) -> BatchError:
    return BatchError(message, ranks=ranks)


class ParityError(RuntimeError):
    """The trainer's logprobs differ from the rollout's (parity: strict); raised before the update."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        sequence: int | None = None,
        position: int | None = None,
        trainer_logprob: float | None = None,
        rollout_logprob: float | None = None,
    ):  # defaults: unpickling (Ray) passes only the message
        super().__init__(message)
        self.rank, self.sequence, self.position = rank, sequence, position
        self.trainer_logprob, self.rollout_logprob = trainer_logprob, rollout_logprob


def parity_error(rank: int, logp, mb, sequences, count: int) -> ParityError:
    """The ParityError of a strict step: the first mismatching token of this rank's micro-batch.

    mb: the micro-batch's padded view (None: an empty one); sequences[i]: the shard row of its
    row i."""
    from rl_engine.logprobs.parity import first_mismatch

    found = None if mb is None else first_mismatch(logp, mb.rollout_logprobs, mb.response_mask)
    if found is None:
        return ParityError(
            f"parity: {count} mismatching token(s) on other ranks (none on rank {rank})", rank=rank
        )
    seq, pos, mine, theirs = found
    prompt_len = int(
        mb.response_mask[seq].nonzero()[0]
    )  # first scored position = prompt length - 1
    return ParityError(
        f"parity: trainer logprob != rollout logprob at rank {rank}, sequence {sequences[seq]} of the shard, "
        f"completion token {pos - prompt_len} (position {pos} scores token {pos + 1}): trainer {mine!r} vs "
        f"rollout {theirs!r} (diff {mine - theirs:.3e}); {count} mismatching token(s) in this micro-batch over "
        f"all ranks; no optimizer step was taken",
        rank=rank,
        sequence=sequences[seq],
        position=pos,
        trainer_logprob=mine,
        rollout_logprob=theirs,
    )
