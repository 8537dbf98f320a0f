"""Before any forward: every rank checks its shard, and the ranks agree on the outcome.

A rank whose check fails, with an exception of any type, must not leave the
others waiting in the step's first collective: the outcome of every rank's check
is all-gathered, and a failure anywhere is a `BatchError` on every rank naming
the rank(s) and why. The shards must also agree on `logprob_temperature`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from rl_engine.config import RunConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.errors import BatchError
from rl_engine.executors.worker.micro_batches import MicroBatch, plan


def agree_on_batch(
    comm: Collectives, check: Callable[[], list[list[MicroBatch]]]
) -> list[list[MicroBatch | None]]:
    """`check()` on this rank (its mini-batches' micro-batches), once every rank's check has passed.

    Also agreed: the micro-batch count of each mini-batch. A rank with fewer micro-batches in
    one than another gets `None` entries appended there (empty micro-batches: they still run a
    forward and a backward, so that every rank takes part in the same collectives).
    """
    try:
        minis, report = check(), None
    except Exception as err:  # any type: the other ranks must hear of it, not wait
        minis = None
        report = str(err) if isinstance(err, BatchError) else f"{type(err).__name__}: {err}"
    temperature = None if minis is None else minis[0][0].batch.logprob_temperature
    counts = None if minis is None else [len(m) for m in minis]
    reports = comm.all_gather((report, temperature, counts))
    bad = [(rank, text) for rank, (text, _, _) in enumerate(reports) if text is not None]
    if bad:
        raise BatchError(
            f"bad batch on rank(s) {', '.join(str(r) for r, _ in bad)}; no forward was run: "
            + "; ".join(f"rank {r}: {text}" for r, text in bad),
            ranks=tuple(r for r, _ in bad),
        )
    temps = [t for _, t, _ in reports]
    if len(set(temps)) > 1:
        raise BatchError(
            "the ranks' shards have different logprob_temperature ("
            + ", ".join(f"rank {r}: {t}" for r, t in enumerate(temps))
            + "); one step's shards must come from one batch, sampled at one temperature",
            ranks=tuple(r for r, t in enumerate(temps) if t != temps[0]),
        )
    most = [max(c[j] for _, _, c in reports) for j in range(len(minis))]
    return [micro + [None] * (n - len(micro)) for micro, n in zip(minis, most)]


def micro_batches(
    batch,
    *,
    vocab_size: int,
    micro_batch_size: int,
    device,
    packing: bool = False,
    max_tokens: int = 0,
) -> list[MicroBatch]:
    """The validated micro-batches of `batch` on `device` (`micro_batches.plan`); raises BatchError."""
    if not isinstance(batch, TrainBatch):
        raise BatchError(f"batch must be a TrainBatch, got {type(batch).__name__}")
    batch.validate(vocab_size)
    return _planned(batch.to(device), micro_batch_size, max_tokens, packing)


def step_mini_batches(
    batch,
    *,
    vocab_size: int,
    micro_batch_size: int,
    device,
    sequences: int,
    mini_batch: int,
    weight_version: int | None = None,
    max_staleness: int = 0,
    packing: bool = False,
    max_tokens: int = 0,
    consecutive: bool = False,
) -> list[list[MicroBatch]]:
    """A training step's shard as mini-batches of `mini_batch` consecutive rows, each planned
    into micro-batches on `device`; raises BatchError.

    The shard must hold exactly `sequences` sequences with a scored token in every
    micro-batch; with `weight_version` (parity 'strict') a batch sampled by another version is
    refused (`max_staleness` > 0, asynchronous runs: one by a later version).
    `MicroBatch.sequences` are rows of the whole shard.
    """
    if not isinstance(batch, TrainBatch):
        raise BatchError(f"batch must be a TrainBatch, got {type(batch).__name__}")
    batch.validate(vocab_size)
    _check_version(batch.weight_version, weight_version, max_staleness)
    _check_step_shard(batch, sequences, micro_batch_size, max_tokens or consecutive)
    batch, minis = batch.to(device), []
    for start in range(0, sequences, mini_batch):
        rows = batch._rows(slice(start, start + mini_batch))
        micro = _planned(rows, micro_batch_size, max_tokens, packing, consecutive)
        micro = [replace(mb, sequences=tuple(start + s for s in mb.sequences)) for mb in micro]
        for index, mb in enumerate(micro):
            if not bool(mb.batch.response_mask.any()):
                where = f" of mini-batch {len(minis)}" if mini_batch < sequences else ""
                raise BatchError(
                    f"micro-batch {index}{where} (sequences {_listed(mb.sequences)}) "
                    "scores no completion token"
                )
        minis.append(micro)
    return minis


def plan_step(
    config: RunConfig,
    batch,
    *,
    vocab_size: int,
    device,
    weight_version: int | None = None,
    max_staleness: int = 0,
) -> list[list[MicroBatch]]:
    """`step_mini_batches` of a training step's shard under the run's trainer settings."""
    trainer = config.trainer
    return step_mini_batches(
        batch,
        vocab_size=vocab_size,
        micro_batch_size=trainer.micro_batch_size,
        device=device,
        sequences=config.sequences_per_rank,
        mini_batch=config.mini_batch_per_rank,
        weight_version=weight_version,
        max_staleness=max_staleness,
        packing=trainer.packing,
        max_tokens=trainer.max_tokens_per_micro_batch,
        consecutive=trainer.layout_invariant,
    )


def plan_scoring(config: RunConfig, batch, *, vocab_size: int, device) -> list[MicroBatch]:
    """`micro_batches` of any number of sequences (a no-grad scoring) under the run's settings."""
    trainer = config.trainer
    return micro_batches(
        batch,
        vocab_size=vocab_size,
        micro_batch_size=trainer.micro_batch_size,
        device=device,
        packing=trainer.packing,
        max_tokens=trainer.max_tokens_per_micro_batch,
    )


def _planned(
    batch, micro_batch_size: int, max_tokens: int, packing: bool, consecutive: bool = False
) -> list[MicroBatch]:
    try:
        return plan(
            batch,
            micro_batch_size=micro_batch_size,
            max_tokens=max_tokens,
            packing=packing,
            consecutive=consecutive,
        )
    except ValueError as err:  # a sequence longer than the token budget
        raise BatchError(f"{err} (trainer.max_tokens_per_micro_batch = {max_tokens})") from None


def _check_version(version: int | None, weight_version: int | None, max_staleness: int) -> None:
    """Synchronous runs train on-policy batches only; asynchronous ones (the job counts their
    staleness in published versions) never a batch of weights this rank has not had yet."""
    if weight_version is None or version is None:
        return
    if version > weight_version or (not max_staleness and version != weight_version):
        allowed = "on-policy batches only" if not max_staleness else "no batch from its future"
        raise BatchError(
            f"stale batch: sampled by weight_version {version} but the worker's weights are "
            f"version {weight_version} (parity 'strict' with rollout.max_staleness = "
            f"{max_staleness} trains {allowed})"
        )


def _check_step_shard(batch, sequences, micro_batch_size, ragged) -> None:
    if batch.num_sequences != sequences:
        how = (
            "sequences_per_step / num_ranks"
            if ragged
            else f"gradient_accumulation_steps x micro_batch_size = "
            f"{sequences // micro_batch_size} x {micro_batch_size}"
        )
        raise BatchError(
            f"this rank's shard has {batch.num_sequences} sequences; a step takes exactly "
            f"{how} = {sequences} per rank"
        )


def _listed(sequences: tuple[int, ...]) -> str:
    """'3..6' for a consecutive run, else '1, 4, 9'."""
    if sequences == tuple(range(sequences[0], sequences[-1] + 1)):
        return f"{sequences[0]}..{sequences[-1]}"
    return ", ".join(map(str, sequences))
