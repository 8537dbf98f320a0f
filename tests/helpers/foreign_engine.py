"""A real foreign rollout engine: Hugging Face `generate` on an unpatched model.

Its per-token logprobs come from the scores `generate` returns: with top_k=0 and
top_p=1.0 the only processor is the temperature warper, so a step's scores are
`logits / T` (fp32) and `log_softmax(scores)` at the sampled token is the
project's definition of a logprob. The numbers come from HF's own decode path
(KV cache, SDPA, plain GEMMs), so they differ from the trainer's recompute: in
bf16 on many tokens (docs/rollouts.md).
"""

from __future__ import annotations

import torch

from rl_engine.models import load_model
from rl_engine.rollout import Completion


def hf_completions(
    model_spec: str,
    dtype: torch.dtype,
    prompts: list[list[int]],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> list[Completion]:
    """`samples_per_prompt` completions per prompt (all prompts one length: no padding), prompt-major."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("hf_completions takes prompts of one length (no padding)")
    model, _ = load_model(model_spec, dtype=dtype, seed=seed)
    eos = model.config.eos_token_id
    ids = torch.tensor(prompts).repeat_interleave(samples_per_prompt, dim=0)  # (B, P)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=eos,
        )
    new = out.sequences[:, ids.shape[1] :]  # (B, N)
    logp = torch.stack(
        [torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1
    )  # (B, N, V)
    token_logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (B, N)
    completions = []
    for row in range(ids.shape[0]):
        tokens = new[row].tolist()
        length = tokens.index(eos) + 1 if eos in tokens else len(tokens)  # cut at EOS, kept
        completions.append(
            Completion(
                prompt_ids=prompts[row // samples_per_prompt],
                token_ids=tokens[:length],
                logprobs=token_logp[row, :length].clone(),
                finish_reason="stop" if eos in tokens else "length",
                weight_version=0,
                prompt_index=row // samples_per_prompt,
                sample_index=row % samples_per_prompt,
                logprob_temperature=temperature,
            )
        )
    return completions
