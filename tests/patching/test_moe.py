"""apply_batch_invariant on the mixture-of-experts families: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE.

Chain checked: token_logprobs(seq alone) == token_logprobs(seq inside any batch,
left- or right-padded) == the same with 1, 2 or 3 threads, and every layer's
routing (the top-k expert list of every token) is the same in all of them, all
torch.equal. A router with two identical expert rows (every token meets an
exact tie) keeps it, and the lower twin always wins. The negative control: the
unpatched HF model breaks the first equality, and its routing disagrees
between layouts on some tokens (the fraction is printed, run with -s).
"""

import pytest
import torch
from torch import nn

from rl_engine.logprobs import token_logprobs
from rl_engine.models import load_model
from rl_engine.patching import RoutingRecorder, apply_batch_invariant, moe_layers
from rl_engine.patching.moe import InvariantMoeExperts, InvariantMoeRouter
from tests.helpers.invariance import assert_equal_across_threads
from tests.helpers.moe_routers import twin_experts
from tests.helpers.padding import pad_sequences, random_sequences, unpad_logprobs

MOE_FAMILIES = ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-olmoe"]
DTYPES = [torch.float32, torch.bfloat16]
LENGTHS = (9, 3, 14, 6, 11)


def _model(name, dtype=torch.float32, patched=True):
    model, _ = load_model(name, dtype=dtype, seed=0)
    if patched:
        apply_batch_invariant(model)
    return model


def _sparse_layers(config) -> list[int]:
    """Layer indices HF builds as sparse blocks (mlp_only_layers / decoder_sparse_step)."""
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    return [i for i in range(config.num_hidden_layers) if i not in only and (i + 1) % step == 0]


def _routing_by_sequence(model, seqs, side):
    """token_logprobs of one padded batch, and per layer each sequence's (T, k) expert lists."""
    ids, mask = pad_sequences(seqs, side)
    with torch.no_grad(), RoutingRecorder(model) as rec:
        lp = token_logprobs(model, ids, mask)
    width = ids.shape[1]
    routing = {}
    for layer, (call,) in rec.calls.items():
        per_row = call.indices.view(len(seqs), width, -1)
        routing[layer] = []
        for i, s in enumerate(seqs):
            start = width - len(s) if side == "left" else 0
            routing[layer].append(per_row[i, start : start + len(s)])
    return unpad_logprobs(lp, seqs, side), routing


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_every_moe_module_is_replaced_and_parameters_and_keys_are_kept(name):
    model = _model(name, patched=False)
    params_before = {id(p) for p in model.parameters()}
    keys_before = list(model.state_dict())
    handle = apply_batch_invariant(model)
    assert {id(p) for p in model.parameters()} == params_before
    assert list(model.state_dict()) == keys_before  # checkpoints and exports keep HF's names
    config = model.config
    shared = config.model_type == "qwen2_moe"  # its block (sigmoid gate) is replaced too
    hf_classes = ("RMSNorm", "TopKRouter", "Experts", *(("SparseMoeBlock",) if shared else ()))
    plain = [
        type(m).__name__
        for m in model.modules()
        if type(m) is nn.Linear
        or "Invariant" not in type(m).__name__
        and type(m).__name__.endswith(hf_classes)
    ]
    assert plain == []
    sparse = _sparse_layers(config)
    counts = handle.summary()
    assert counts["moe_router"] == counts["moe_experts"] == len(sparse) >= 1
    assert counts.get("moe_block", 0) == (len(sparse) if shared else 0)
    dense = config.num_hidden_layers - len(sparse)
    assert counts.get("silu", 0) == dense + (len(sparse) if shared else 0)
    assert moe_layers(model) == [f"model.layers.{i}.mlp.gate" for i in sparse]
    for i in sparse:
        mlp = model.model.layers[i].mlp
        assert isinstance(mlp.gate, InvariantMoeRouter) and isinstance(
            mlp.experts, InvariantMoeExperts
        )


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_patched_logits_match_hf_and_revert_restores_it(name):
    model = _model(name, patched=False)
    ids = torch.randint(3, model.config.vocab_size, (3, 10))
    with torch.no_grad():
        plain = model(ids).logits
        handle = apply_batch_invariant(model)
        patched = model(ids).logits
        torch.testing.assert_close(patched.float(), plain.float(), atol=2e-5, rtol=1e-4)
        handle.revert()
        assert torch.equal(model(ids).logits, plain)
    assert not any("Invariant" in type(m).__name__ for m in model.modules())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_logprobs_and_routing_independent_of_batch_and_padding(name, dtype):
    model = _model(name, dtype)
    seqs = random_sequences(model.config.vocab_size, LENGTHS, seed=1)
    alone = [_routing_by_sequence(model, [s], "right") for s in seqs]
    for side in ("left", "right"):
        logps, routing = _routing_by_sequence(model, seqs, side)
        for i, (lp_alone, routing_alone) in enumerate(alone):
            assert torch.equal(logps[i], lp_alone[0]), f"{side}: sequence {i} logprobs"
            for layer, rows in routing.items():
                assert torch.equal(rows[i], routing_alone[layer][0]), f"{side}: {layer} routing"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_negative_control_unpatched_moe_differs_and_its_routing_disagrees(dtype):
    fractions = {}
    for name in MOE_FAMILIES:
        model = _model(name, dtype, patched=False)
        seqs = random_sequences(model.config.vocab_size, (13, 2, 17, 5, 9, 15), seed=2)
        alone = [_routing_by_sequence(model, [s], "right") for s in seqs]
        logps, routing = _routing_by_sequence(model, seqs, "left")
        exact = torch.cat([a[0][0] == b for a, b in zip(alone, logps)]).float().mean().item()
        same, total = 0, 0
        for layer, rows in routing.items():
            for i, r in enumerate(rows):
                same += int((r == alone[i][1][layer][0]).all(-1).sum())
                total += r.shape[0]
        fractions[name] = (exact, same / total)
    print(
        f"\nunpatched HF MoE ({dtype}), left-padded batch vs alone: (exact logprobs, same routing)"
    )
    for name, (exact, agree) in fractions.items():
        print(f"  {name}: {exact:.1%} exact, routing identical for {agree:.1%} of token-layers")
    assert all(exact < 1.0 for exact, _ in fractions.values())


def test_negative_control_near_tie_routers_flip_unpatched_routing_with_the_batch():
    """Twins that differ by ~1e-6: the plain router's rounding decides between them, and it
    follows the batch; the patched router decides the same way in every layout."""
    agreement = {}
    for patched in (False, True):
        model = twin_experts(_model("tiny-qwen3-moe", patched=False), scale=1e-6)
        if patched:
            apply_batch_invariant(model)
        seqs = random_sequences(model.config.vocab_size, (13, 2, 17, 5, 9, 15), seed=5)
        alone = [_routing_by_sequence(model, [s], "right")[1] for s in seqs]
        _, routing = _routing_by_sequence(model, seqs, "left")
        same = [
            (rows[i] == alone[i][layer][0]).all(-1)
            for layer, rows in routing.items()
            for i in range(len(seqs))
        ]
        agreement[patched] = torch.cat(same).float().mean().item()
    print(f"\nnear-tie routers, routing identical alone vs batched: plain {agreement[False]:.1%}")
    assert agreement[True] == 1.0 and agreement[False] < 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_router_with_two_identical_expert_rows_keeps_every_tie_invariant(dtype):
    """Experts 1 and 5 of every router share their weight row: each token's logits tie exactly."""
    model = twin_experts(_model("tiny-qwen3-moe", patched=False)).to(dtype)
    apply_batch_invariant(model)
    seqs = random_sequences(model.config.vocab_size, LENGTHS, seed=3)
    alone = [_routing_by_sequence(model, [s], "right") for s in seqs]
    logps, routing = _routing_by_sequence(model, seqs, "left")
    picked_twin = 0
    for i, (lp, rt) in enumerate(alone):
        assert torch.equal(logps[i], lp[0])
        for layer, rows in routing.items():
            assert torch.equal(rows[i], rt[layer][0])
            has = {e: (rows[i] == e).any(-1) for e in (1, 5)}
            assert not bool((has[5] & ~has[1]).any()), "the higher twin chosen without the lower"
            first = {e: (rows[i] == e).int().argmax(-1) for e in (1, 5)}
            assert bool((first[1] < first[5])[has[5]].all()), "the higher twin ranked first"
            picked_twin += int(has[1].sum())
    assert picked_twin > 0, "the tie never mattered: no token chose the twins"


THREADS_CODE = """
import torch
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.logprobs import token_logprobs
from tests.helpers.padding import pad_sequences, random_sequences
result = {}
for name in ("tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-olmoe"):
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(name, dtype=dtype)
        apply_batch_invariant(model)
        ids, mask = pad_sequences(random_sequences(model.config.vocab_size, (9, 3, 14)), "left")
        with torch.no_grad():
            result[f"{name} {dtype}"] = token_logprobs(model, ids, mask)
"""


@pytest.mark.multiprocess
@pytest.mark.threads
@pytest.mark.exhaustive  # make test: tests/rollout/test_threads.py (MoE) and tests/kernels/common/test_moe_experts.py
def test_thread_count_invariance():
    assert_equal_across_threads(THREADS_CODE, threads=(1, 2, 3))


def test_jitter_noise_and_unsupported_expert_layouts_are_refused():
    model = _model("tiny-mixtral", patched=False)
    model.config.router_jitter_noise = 0.1
    with pytest.raises(NotImplementedError, match="router_jitter_noise=0.1"):
        apply_batch_invariant(model)
    model.config.router_jitter_noise = 0.0
    model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(NotImplementedError, match="has_bias is True"):
        apply_batch_invariant(model)


@pytest.mark.triton
def test_triton_backend_patches_an_moe_model_under_the_interpreter():
    model = _model("tiny-olmoe", patched=False)
    ids = torch.randint(3, model.config.vocab_size, (2, 5))
    with torch.no_grad():
        plain = model(ids).logits
        apply_batch_invariant(model, backend="triton")
        patched = model(ids).logits
    router = model.model.layers[0].mlp.gate
    assert router.op.__module__ == "rl_engine.kernels.triton.moe_router"
    assert model.model.layers[0].mlp.experts.op.__module__ == "rl_engine.kernels.triton.moe_experts"
    torch.testing.assert_close(patched.float(), plain.float(), atol=1e-4, rtol=1e-4)
