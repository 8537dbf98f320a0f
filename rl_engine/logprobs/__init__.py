"""Per-token logprobs: THE trainer-side definition, and how far two sets of them differ.

- `teacher_forced`: `token_logprobs` / `score_targets` (padded) and their packed forms, through
  the model's hidden states and the fused `linear_logp` op.
- `packing`: the packed layout (`PackedBatch`: sequences concatenated in rows, positions
  restarting at 0) and micro-batch plans under a token budget;
- `parity`: the one definition of the mismatch between two logprob sets (the worker's
  `parity/*` step metrics and the diagnostics both use it).
"""

from rl_engine.logprobs.teacher_forced import (
    IGNORE_INDEX,
    final_hidden_states,
    packed_final_hidden_states,
    packed_score_targets,
    packed_token_logprobs,
    positions_from_attention_mask,
    score_targets,
    scored_targets,
    token_logprobs,
)

__all__ = [
    "IGNORE_INDEX",
    "final_hidden_states",
    "packed_final_hidden_states",
    "packed_score_targets",
    "packed_token_logprobs",
    "positions_from_attention_mask",
    "score_targets",
    "scored_targets",
    "token_logprobs",
]
