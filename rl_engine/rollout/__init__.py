"""Rollout engine: continuous-batching KV-cache generation with per-token logprobs.

`RolloutEngine(model, device=...)`.generate(prompts, SamplingParams(...)) ->
list[Completion]; with a patched model every recorded logprob equals the
trainer's teacher-forced recompute (`rl_engine.logprobs.token_logprobs`) bit
for bit.
"""

from rl_engine.rollout.engine import Completion, GenerateStats, RolloutEngine
from rl_engine.rollout.kv_cache import SlotKVCache
from rl_engine.rollout.sampling import SamplingParams

__all__ = ["Completion", "GenerateStats", "RolloutEngine", "SamplingParams", "SlotKVCache"]
