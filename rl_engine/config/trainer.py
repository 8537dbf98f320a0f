"""The `trainer:` section: the DeepSpeed training ranks (executors/worker/) and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_engine.config.rollout import PLACEMENTS
from rl_engine.base.fields import check_bool, check_choice, check_int, check_number, fail

PARITY_SCOPES = ("first", "all")
ZERO_STAGES = (0, 1, 2, 3)


def _default_deepspeed() -> dict:
    return {"zero_optimization": {"stage": 0}, "steps_per_print": 1_000_000}


def check_zero_stage(name: str, value) -> None:
    """null or a ZeRO stage (trainer.zero_stage, critic.zero_stage)."""
    if value is not None and value not in ZERO_STAGES:
        fail(name, "null or one of 0, 1, 2, 3", value)


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """DeepSpeed training ranks and the optimizer."""

    num_ranks: int = 1
    """Data-parallel DeepSpeed ranks (WORLD_SIZE)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank (train_micro_batch_size_per_gpu); with a
    token budget, the most sequences one micro-batch may hold."""
    packing: bool = True
    """Micro-batches as packed rows: a micro-batch's sequences concatenated in one row,
    positions restarting at 0, no padding computed. The logprobs are bitwise those of the
    padded layout (false: right-padded rows, every row as wide as the step's longest)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one micro-batch (0 = off: micro_batch_size sequences each). With N > 0
    a micro-batch holds at most N tokens (packed: its sequences' lengths summed; padded: their
    count x the longest) and at most micro_batch_size sequences, assigned by a balanced plan
    that depends on the lengths only; the number of micro-batches then varies per step. A
    sequence longer than N is a BatchError naming both numbers."""
    mini_batch_size: int = 0
    """Sequences per optimizer step, over all ranks (0 = the whole step: one update per RL step,
    as before). The step's batch splits into sequences_per_step / mini_batch_size mini-batches,
    each rank taking its rows of each; every mini-batch is one optimizer step (its own
    accumulation boundary and loss normaliser). The ratio's old logprobs are the rollout's."""
    epochs: int = 1
    """Passes over the step's batch: epochs x mini-batches optimizer steps per RL step."""
    parity_scope: str = "all"
    """Which sequences parity checks, always on a forward of the pre-update policy: 'first'
    (the first mini-batch's, from its training forward: free) or 'all' (also one no-grad
    scoring pass over the other mini-batches before the first update). One mini-batch: the
    same, at no cost. algorithm.rollout_correction other than 'none' always runs the pass."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (DeepSpeed gradient_clipping; 0 = off)."""
    deepspeed: dict | str = field(default_factory=_default_deepspeed)
    """DeepSpeed config: a dict or a path to a JSON file (default: ZeRO-0 built in code)."""
    zero_stage: int | None = None
    """Overrides deepspeed.zero_optimization.stage when set (0-3)."""
    placement: str = "pack"
    """Where the ranks go: 'pack' (few nodes), 'spread' or 'strict_spread' (one per node)."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer than this fails with an error instead of hanging (the
    weight group's sends and receives too)."""
    layout_invariant: bool = False
    """The update does not depend on the layout: runs that differ only in num_ranks, the ZeRO
    stage, micro_batch_size, max_tokens_per_micro_batch, packing or placement take the same
    optimizer steps, bit for bit, and a checkpoint resumes on another layout. Each parameter's
    gradient is a fixed tree over the mini-batch's sequences (docs/usage.md#layout-invariant-training);
    false: DeepSpeed's own reduction and optimizer step."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input through the forward and recompute the layer in
    the backward (Hugging Face's activation checkpointing, torch's non-reentrant checkpoint):
    a rank's activations shrink to one layer's at a time, for about one more forward per step.
    The recompute runs the same ops on the same inputs, so the step is bit for bit the one
    without it (false: every layer's activations held through the backward)."""
    weight_sync_bucket_mb: float = 128.0
    """Most MiB a weight sync moves per bucket (the trainer ranks send their weights straight
    to the engines, a bucket at a time), and most MiB of parameters a ZeRO-3 rank gathers at
    once to export or checkpoint them."""

    def __post_init__(self) -> None:
        check_int("trainer.num_ranks", self.num_ranks, 1)
        check_int("trainer.micro_batch_size", self.micro_batch_size, 1)
        check_bool("trainer.packing", self.packing)
        check_int("trainer.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 0)
        check_int("trainer.mini_batch_size", self.mini_batch_size, 0)
        check_int("trainer.epochs", self.epochs, 1)
        check_choice("trainer.parity_scope", self.parity_scope, PARITY_SCOPES)
        check_number("trainer.lr", self.lr, low=0.0, low_open=True)
        check_number("trainer.weight_decay", self.weight_decay, low=0.0)
        check_number("trainer.grad_clip", self.grad_clip, low=0.0)
        if not isinstance(self.deepspeed, (dict, str)) or self.deepspeed == "":
            fail("trainer.deepspeed", "a dict or a path to a JSON file", self.deepspeed)
        check_zero_stage("trainer.zero_stage", self.zero_stage)
        check_choice("trainer.placement", self.placement, PLACEMENTS)
        check_bool("trainer.layout_invariant", self.layout_invariant)
        check_bool("trainer.activation_checkpointing", self.activation_checkpointing)
        check_number(
            "trainer.collective_timeout_s", self.collective_timeout_s, low=0.0, low_open=True
        )
        check_number(
            "trainer.weight_sync_bucket_mb", self.weight_sync_bucket_mb, low=0.0, low_open=True
        )

    @property
    def ragged_micro_batches(self) -> bool:
        """Whether the micro-batch count may vary per mini-batch (a token budget, or the
        layout-invariant mode's micro-batches of at most micro_batch_size consecutive
        sequences): the worker then marks each optimizer step's last micro-batch itself."""
        return bool(self.max_tokens_per_micro_batch) or self.layout_invariant

    @property
    def weight_sync_bucket_bytes(self) -> int:
        """`weight_sync_bucket_mb` in bytes (at least 1)."""
        return max(1, int(self.weight_sync_bucket_mb * 2**20))
