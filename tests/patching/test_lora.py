"""LoRA layers under the patch: the invariant unmerged expression, the same Parameters, revert.

Every comparison of invariance is `torch.equal`; the adapters are perturbed (B != 0).
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.logprobs import token_logprobs
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.patching.lora import add_lora, linear_names, lora_layers, resolve_targets
from rl_engine.patching.modules import InvariantLinear
from tests.helpers.lora_policy import lora_model, merge_adapters, unpatch_adapters

CASES = [("tiny-llama", torch.float32), ("tiny-qwen3", torch.bfloat16)]
EXHAUSTIVE = [
    pytest.param(name, dtype, marks=pytest.mark.exhaustive)
    for name, dtype in (
        ("tiny-llama", torch.bfloat16),
        ("tiny-qwen2", torch.float32),
        ("tiny-mistral", torch.float32),
        ("tiny-qwen3-moe", torch.bfloat16),
        ("tiny-mixtral", torch.float32),
        ("tiny-olmoe", torch.float32),
    )
]


def _ids(vocab: int, rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _logprobs(model, ids):
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))


def test_every_lora_layer_is_patched_with_the_same_parameters_and_revert_restores():
    model = lora_model("tiny-llama")
    before = {name: p for name, p in model.named_parameters()}
    ids = _ids(model.config.vocab_size, 2, 7, 0)
    plain = model(ids).logits
    handle = apply_batch_invariant(model)
    layers = lora_layers(model)
    assert handle.summary()["lora"] == len(layers) == 14
    for _, layer in layers:
        assert "forward" in vars(layer)
        assert isinstance(layer.base_layer, InvariantLinear)
        assert isinstance(layer.lora_A["default"], InvariantLinear)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n in before if ".lora_" in n
    ]
    handle.revert()
    assert all("forward" not in vars(layer) for _, layer in layers)
    assert torch.equal(model(ids).logits, plain)


@pytest.mark.parametrize(
    ("name", "dtype"), [*CASES, ("tiny-qwen2-moe", torch.float32), *EXHAUSTIVE]
)
def test_lora_logprobs_independent_of_the_batch(name, dtype):
    model = lora_model(name, dtype)
    apply_batch_invariant(model)
    probe = _ids(model.config.vocab_size, 1, 9, 1)
    alone = _logprobs(model, probe)
    for rows, seed in ((3, 2), (8, 3)):
        batch = _ids(model.config.vocab_size, rows, 9, seed)
        batch[rows // 2] = probe[0]
        assert torch.equal(_logprobs(model, batch)[rows // 2], alone[0])


def _invariant_reference(name, dtype, ids):
    model = lora_model(name, dtype)
    apply_batch_invariant(model)
    return _logprobs(model, ids)


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_an_adapter_merged_into_w_differs_from_the_unmerged_forward(name, dtype):
    """Negative control: the parity tests would see an engine that merges the adapter."""
    ids = _ids(999, 4, 9, 4)
    merged = lora_model(name, dtype)
    merge_adapters(merged)
    apply_batch_invariant(merged)
    assert not torch.equal(_logprobs(merged, ids), _invariant_reference(name, dtype, ids))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_plain_peft_adapters_differ_from_the_invariant_forward(name):
    """Negative control: the parity tests would see plain PEFT (torch's linear for A and B).
    A wide adapter (rank 1024: B's reduction is 1024 terms long), because at short reductions
    torch's GEMM can happen to sum in the fixed order: at rank 4 it did on an AVX-512 Xeon (every
    dtype), and at tiny bf16 shapes on the AMD EPYCs."""
    ids = _ids(999, 4, 9, 4)
    plain = lora_model(name, rank=1024)
    apply_batch_invariant(plain)
    unpatch_adapters(plain)
    invariant = lora_model(name, rank=1024)
    apply_batch_invariant(invariant)
    assert not torch.equal(_logprobs(plain, ids), _logprobs(invariant, ids))


def test_moe_targets_are_attention_and_shared_expert_linears_never_the_router():
    model, _ = load_model("tiny-qwen2-moe")
    add_lora(model, rank=2, alpha=4, target_modules="all-linear", seed=0)
    adapted = [name for name, _ in lora_layers(model)]
    assert adapted and not any("gate." in n or n.endswith(".gate") for n in adapted)
    assert not any(n.endswith("shared_expert_gate") or ".experts" in n for n in adapted)
    assert any(".shared_expert." in n for n in adapted)
    assert all(".self_attn." in n or ".shared_expert." in n for n in adapted)  # no dense MLP
    mixtral, _ = load_model("tiny-mixtral")
    assert linear_names(mixtral) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # PEFT would map gate/up/down onto Qwen3-MoE's 3-D experts: attention only, no expert adapter
    qwen3_moe, _ = load_model("tiny-qwen3-moe")
    add_lora(qwen3_moe, rank=2, alpha=4, target_modules="all-linear", seed=0)
    names = [n for n, _ in qwen3_moe.named_parameters() if ".lora_" in n]
    assert names and all(".self_attn." in n for n in names)


def test_an_unknown_target_names_the_key_and_lists_the_linears():
    model, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match=r"lora.target_modules: \['qproj'\].*'q_proj'"):
        resolve_targets(model, ["q_proj", "qproj"])
    assert resolve_targets(model, ["v_proj", "q_proj"]) == ["q_proj", "v_proj"]


def test_the_adapter_is_the_same_for_the_same_seed_and_adding_after_patching_raises():
    a, b = (load_model("tiny-llama")[0] for _ in range(2))
    for m in (a, b):
        add_lora(m, rank=4, alpha=8, target_modules=["q_proj"], seed=5)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c, _ = load_model("tiny-llama")
    apply_batch_invariant(c)
    with pytest.raises(ValueError, match="before apply_batch_invariant"):
        add_lora(c, rank=4, alpha=8, target_modules="all-linear", seed=0)
