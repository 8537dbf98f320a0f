"""Rollout engine: continuous-batching KV-cache generation with per-token logprobs.

`RolloutEngine(model, device=...)`.generate(prompts, SamplingParams(...)) ->
list[Completion]; with a patched model every recorded logprob equals the
trainer's teacher-forced recompute (`rl_engine.logprobs.token_logprobs`) bit
for bit. `read_rollouts` / `write_rollouts`: completions of any engine as JSONL
(docs/rollouts.md).
"""

from rl_engine.rollout.completion import Completion
from rl_engine.rollout.engine import RolloutEngine
from rl_engine.rollout.files import RolloutFileError, read_rollouts, write_rollouts
from rl_engine.rollout.kv_cache import SlotKVCache
from rl_engine.rollout.sampling import SamplingParams
from rl_engine.rollout.scheduler import GenerateStats

__all__ = [
    "Completion",
    "GenerateStats",
    "RolloutEngine",
    "RolloutFileError",
    "SamplingParams",
    "SlotKVCache",
    "read_rollouts",
    "write_rollouts",
]
