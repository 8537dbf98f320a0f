"""Parity beyond the tiny configs: hidden > 1024 (sliced reductions in every linear), head_dim 128
and an odd 110, odd vocabularies, GQA 9/3 and 10/2, tied and untied heads.

Chain checked: engine logprob of every sampled token (continuous batching, 3
slots for 10 requests) == token_logprobs of the patched model over the finished
sequence, torch.equal.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rl_engine.logprobs import token_logprobs
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams

CONFIGS = {
    "llama-h1152-d128": lambda: LlamaConfig(
        vocab_size=5003,
        hidden_size=1152,
        intermediate_size=2600,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "qwen2-h1100-d110-tied": lambda: Qwen2Config(
        vocab_size=4099,
        hidden_size=1100,
        intermediate_size=3000,
        num_hidden_layers=2,
        num_attention_heads=10,
        num_key_value_heads=2,
        head_dim=110,
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_midsize_engine_logprobs_equal_recompute(name, dtype):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    apply_batch_invariant(model)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (5, 130, 17, 64, 9)
    ]
    completions = engine.generate(
        prompts, SamplingParams(max_new_tokens=12, temperature=0.7, n=2, seed=1)
    )
    with torch.no_grad():
        for c in completions:
            ids = torch.tensor([c.prompt_ids + c.token_ids])
            recomputed = token_logprobs(model, ids, temperature=0.7)[0, len(c.prompt_ids) - 1 :]
            assert torch.equal(recomputed, c.logprobs), (
                f"prompt {c.prompt_index} sample {c.sample_index}"
            )
