"""The `rollout:` section: the rollout engines (Ray actors), the step's prompts, sampling.

Its sampling keys (max_new_tokens, temperature, top_p, top_k) are inherited from
rl_engine.rollout.sampling.SamplingKeys, which SamplingParams shares: one place names them,
gives their defaults and checks them. The rest configures the job's use of the engines.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.fields import check_bool, check_choice, check_int, check_text
from rl_engine.rollout.sampling import SamplingKeys
from rl_engine.rollout.tp.layout import TENSOR_PARALLEL_SIZES

PLACEMENTS = ("pack", "spread", "strict_spread")
"""Ray placement strategies of the engines (rollout.placement) and ranks (trainer.placement)."""

__all__ = ["PLACEMENTS", "TENSOR_PARALLEL_SIZES", "RolloutConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig(SamplingKeys):
    """Rollout engines and sampling (frozen, as SamplingKeys: SamplingParams is hashable)."""

    num_engines: int = 1
    """Number of rollout engines (Ray actors)."""
    max_batch_size: int = 8
    """Most sequences one engine decodes at once."""
    share_prompt_prefill: bool = True
    """Samples of one prompt share one prefill (its KV rows copied into each sample's slot);
    tokens and logprobs stay bit for bit those of a prefill per sample."""
    prompts_per_step: int = 4
    """Prompts sampled per training step."""
    samples_per_prompt: int = 4
    """Completions per prompt: the GRPO group size."""
    task: str = "count"
    """'count', 'arithmetic', 'module:function' (your reward over the built-in prompts) or
    'jsonl:PATH' (a prompt file, one {"prompt": str, "answer": str} per line). Leave it at
    'count' with data.train_files or reward.function: those then give the prompts / rewards."""
    placement: str = "pack"
    """Where the engines go: 'pack' (few nodes), 'spread' or 'strict_spread' (one per node)."""
    source: str | None = None
    """Rollout file or folder of step_N.jsonl files to train on instead of generating (docs/rollouts.md)."""
    save: bool = False
    """Write each step's completions and rewards to <output_dir>/rollouts/step_N.jsonl."""
    tensor_parallel_size: int = 1
    """Processes one engine is split over (1, 2 or 4): output shards only, so completions and
    logprobs equal the TP = 1 engine's bit for bit (docs/scaling.md). Must divide the model's
    query heads; KV heads may be fewer (replicated); vocabulary and MLP width need not divide."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (no learning
    signal) and generate groups for more prompts until prompts_per_step groups are kept."""
    filter_groups_max_tries: int = 4
    """Most generation rounds of prompts_per_step prompts one step makes under filter_groups
    (the first included). A step still short after them is filled with the dropped groups in
    order (counted in rollout/filter_filled)."""

    def __post_init__(self) -> None:
        for name in ("num_engines", "max_batch_size", "prompts_per_step", "samples_per_prompt"):
            check_int(f"rollout.{name}", getattr(self, name), 1)
        self.check_sampling_keys("rollout.")
        check_text("rollout.task", self.task)
        check_choice("rollout.placement", self.placement, PLACEMENTS)
        if self.source is not None:
            check_text("rollout.source", self.source)
        check_bool("rollout.share_prompt_prefill", self.share_prompt_prefill)
        check_bool("rollout.save", self.save)
        check_bool("rollout.filter_groups", self.filter_groups)
        check_choice(
            "rollout.tensor_parallel_size", self.tensor_parallel_size, TENSOR_PARALLEL_SIZES
        )
        check_int("rollout.filter_groups_max_tries", self.filter_groups_max_tries, 1)
