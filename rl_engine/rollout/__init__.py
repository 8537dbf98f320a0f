"""Rollout engine: continuous-batching KV-cache generation with per-token logprobs.

`RolloutEngine(model, device=...)`.generate(prompts, SamplingParams(...)) ->
list[Completion]; with a patched model every recorded logprob equals the
trainer's teacher-forced recompute (`rl_engine.logprobs.token_logprobs`) bit
for bit. `generate_episodes(starts, sampling, on_turn_end, max_total_tokens=...)` plays
multi-turn episodes (`TurnStart`, `Continuation`: turns.py), each next turn continued in its
own KV slot beside the other sequences' decodes. `read_rollouts` / `write_rollouts`: completions of any engine as JSONL
(docs/rollouts.md).
"""

from rl_engine.rollout.completion import Completion
from rl_engine.rollout.engine import RolloutEngine
from rl_engine.rollout.files import RolloutFileError, read_rollouts, write_rollouts
from rl_engine.rollout.kv_cache import SlotKVCache
from rl_engine.rollout.sampling import SamplingParams
from rl_engine.rollout.scheduler import GenerateStats
from rl_engine.rollout.turns import Continuation, TurnStart

__all__ = [
    "Completion",
    "Continuation",
    "GenerateStats",
    "RolloutEngine",
    "RolloutFileError",
    "SamplingParams",
    "SlotKVCache",
    "TurnStart",
    "read_rollouts",
    "write_rollouts",
]
