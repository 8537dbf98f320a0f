"""`ExactSampler`: rl_engine's sampler inside vLLM, in place of vLLM's `Sampler`.

vLLM draws a token with a per-request `torch.Generator` in call order; rl_engine's own
engine draws the token at index k of a completion from the position-keyed uniform
`token_uniform(key, k)` (rollout/sampling.py), where `key` is the request's
`request_key(seed, prompt, sample)` (or a turn's `turn_key`). With this sampler a request
that carries its key in `SamplingParams.extra_args["rl_engine_key"]` samples in vLLM the
tokens the own engine samples: the same logprobs (the trainer's `log_softmax` op at the
request's temperature, over the full vocabulary) and the same uniform per position, so the
same completion whatever the batch, chunking, preemption or prefix caching.

The index of a row's token is read from the positions of the forward that produced its
logits (`ExactCausalLM.sample_positions`): the new token sits one past its request's last
scheduled position, and its index is that position minus the prompt's length. A row still
in a partial prefill (index < 0) gets a placeholder vLLM discards.

Installed per worker by the worker extension (worker.py: `rl_engine_install_sampler`).
Refused: speculative decoding (vLLM's rejection sampler), penalties, logit bias, bad words,
allowed-token masks, min-p, top-n logprobs (ExactVllmUnsupported names the setting).
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.rollout.sampling import SamplingParams, sample_token, token_uniform
from rl_engine.rollout.vllm.checks import ExactVllmUnsupported

KEY_ARG = "rl_engine_key"
"""The `SamplingParams.extra_args` entry that carries a request's rl_engine sampling key."""


class ExactSampler(nn.Module):
    """vLLM's sampler interface (`forward(logits, sampling_metadata)` -> SamplerOutput),
    drawing with rl_engine's position-keyed sampler."""

    def __init__(self, model_runner, model):
        super().__init__()
        self.runner, self.model = model_runner, model
        self.logprobs_mode = "raw_logprobs"  # read by vLLM's model runner
        self._params: dict[tuple, SamplingParams] = {}

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, **_):
        from vllm.v1.outputs import SamplerOutput

        if any(sampling_metadata.spec_token_ids or ()) or predict_bonus_token:
            raise ExactVllmUnsupported("the exact sampler does not verify draft tokens")
        _check_metadata(sampling_metadata)
        requests = [self.runner.requests[r] for r in self.runner.input_batch.req_ids]
        positions = self.model.sample_positions
        if positions is None or positions.numel() != len(requests):
            raise RuntimeError(
                f"ExactSampler: {len(requests)} requests to sample but the last forward "
                f"recorded {None if positions is None else positions.numel()} sample positions"
            )
        tokens, logprobs = self._draw(logits, requests, positions.tolist())
        return SamplerOutput(
            sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1),
            logprobs_tensors=_logprobs_tensors(tokens, logprobs, sampling_metadata),
        )

    def _draw(self, logits, requests, last_positions) -> tuple[torch.Tensor, torch.Tensor]:
        """(R,) int64 tokens and (R, V) fp32 logprobs at each row's own temperature."""
        rows = len(requests)
        tokens = torch.zeros(rows, dtype=torch.long)
        params = [self._sampling(request) for request in requests]
        logprobs = torch.empty(rows, logits.shape[-1], dtype=torch.float32)
        for temperature in sorted({p.logprob_temperature for p in params}):
            picked = [i for i, p in enumerate(params) if p.logprob_temperature == temperature]
            logprobs[picked] = self.model.log_softmax(logits[picked], temperature)
        for row, (request, sampling, last) in enumerate(zip(requests, params, last_positions)):
            index = last + 1 - len(request.prompt_token_ids)
            if index < 0:  # a partial prefill: vLLM discards this row's token
                continue
            key = _key(request)
            tokens[row] = sample_token(logprobs[row], sampling, token_uniform(key, index))
        return tokens, logprobs

    def _sampling(self, request) -> SamplingParams:
        """rl_engine's SamplingParams for a vLLM request (its temperature, top-p, top-k)."""
        vllm_params = request.sampling_params
        top_k = vllm_params.top_k if vllm_params.top_k and vllm_params.top_k > 0 else 0
        found = (float(vllm_params.temperature), float(vllm_params.top_p), int(top_k))
        if found not in self._params:
            temperature, top_p, top_k = found
            self._params[found] = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        return self._params[found]


def _key(request) -> int:
    extra = request.sampling_params.extra_args or {}
    if KEY_ARG not in extra:
        raise ExactVllmUnsupported(
            f"request {request.req_id} has no SamplingParams.extra_args[{KEY_ARG!r}]: the exact "
            "sampler draws each token from the request's rl_engine key (rollout/sampling.py "
            "request_key)"
        )
    return int(extra[KEY_ARG])


def _check_metadata(metadata) -> None:
    """Every vLLM sampling feature that would change the drawn token or its logprob."""
    refused = {
        "penalties (presence / frequency / repetition)": not metadata.no_penalties,
        "allowed_token_ids": metadata.allowed_token_ids_mask is not None,
        "bad_words": bool(metadata.bad_words_token_ids),
        "logprob_token_ids": bool(metadata.logprob_token_ids),
        "top-n logprobs (logprobs > 0)": bool(metadata.max_num_logprobs),
    }
    refused.update(_logits_processors(metadata))
    for name, used in refused.items():
        if used:
            raise ExactVllmUnsupported(f"the exact sampler does not support {name}")


def _logits_processors(metadata) -> dict[str, bool]:
    """vLLM's built-in logits processors change logits only for the requests that ask for
    them (min_tokens, logit_bias, min_p): each one that holds a request is refused, and so
    is any other (a custom processor's effect is unknown)."""
    from vllm.v1.sample.logits_processor import builtin

    state = {
        builtin.MinTokensLogitsProcessor: "min_toks",
        builtin.LogitBiasLogitsProcessor: "biases",
        builtin.MinPLogitsProcessor: "min_p_count",
    }
    found = {}
    for processor in metadata.logitsprocs.all:
        field = state.get(type(processor))
        used = field is None or bool(getattr(processor, field))
        found[f"logits processor {type(processor).__name__}"] = used
    return found


def _logprobs_tensors(tokens, logprobs, metadata):
    """The sampled token's logprob per row (vLLM's `logprobs=0`), or None if none asked."""
    if metadata.max_num_logprobs is None:
        return None
    from vllm.v1.outputs import LogprobsTensors

    sampled = logprobs.gather(-1, tokens.unsqueeze(-1))  # (R, 1)
    ranks = (logprobs > sampled).sum(-1) + 1
    return LogprobsTensors(tokens.to(torch.int32).unsqueeze(-1), sampled, ranks)
