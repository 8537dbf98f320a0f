"""apply_batch_invariant and token_logprobs on real HF models of every supported family.

Chain checked: token_logprobs(seq alone) == token_logprobs(seq inside any batch,
left- or right-padded) == the same with 1, 2 or 3 threads, all torch.equal.
The negative control shows the unpatched model breaks the first equality.
"""

import pytest
import torch
from torch import nn

from rl_engine.kernels import OP_NAMES, get_op
from rl_engine.logprobs import token_logprobs
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant, attention_name, is_patched, model_op
from tests.helpers.invariance import assert_equal_across_threads
from tests.helpers.padding import pad_sequences, random_sequences, unpad_logprobs

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]


def _model(name, dtype=torch.float32, patched=True):
    model, _ = load_model(name, dtype=dtype, seed=0)
    if patched:
        apply_batch_invariant(model)
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_every_op_on_the_path_is_replaced_and_parameters_are_kept(name):
    model = _model(name, patched=False)
    params_before = {id(p) for p in model.parameters()}
    tied = model.config.tie_word_embeddings
    handle = apply_batch_invariant(model)
    assert {id(p) for p in model.parameters()} == params_before
    assert not any(
        type(m) is nn.Linear
        or type(m).__name__.endswith("RMSNorm")
        and "Invariant" not in type(m).__name__
        for m in model.modules()
    )
    assert not any(type(m) is nn.Embedding for m in model.modules())
    counts = handle.summary()
    layers = model.config.num_hidden_layers
    assert counts["linear"] == 7 * layers and counts["silu"] == layers
    assert counts["lm_head"] == counts["embedding"] == counts["attention"] == 1
    expected_norms = 2 * layers + 1 + (2 * layers if model.config.model_type == "qwen3" else 0)
    assert counts["rms_norm"] == expected_norms
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    assert model.config._attn_implementation == attention_name("cpp")


def test_apply_twice_is_harmless_and_revert_restores_the_plain_model():
    model = _model("tiny-qwen3", patched=False)
    ids = torch.randint(3, 999, (2, 9))
    plain = model(ids).logits
    handle = apply_batch_invariant(model)
    assert apply_batch_invariant(model) is handle
    patched = model(ids).logits
    torch.testing.assert_close(patched.float(), plain.float(), atol=1e-4, rtol=1e-4)
    handle.revert()
    assert not is_patched(model) and model.config._attn_implementation == "sdpa"
    assert torch.equal(model(ids).logits, plain)
    assert not any("Invariant" in type(m).__name__ for m in model.modules())


def test_ops_are_resolved_for_the_parameters_device_and_checked_at_forward():
    """Patching resolves every op once, for the device the parameters are on; a model moved to
    another device type afterwards fails at its first forward instead of running the wrong ops."""
    model = _model("tiny-llama", patched=False)
    handle = apply_batch_invariant(model)
    assert (handle.backend, handle.device_type) == ("cpp", "cpu")
    assert set(handle.ops) == set(OP_NAMES)
    ops = [m.op for m in model.modules() if hasattr(m, "op")]
    resolved = {get_op(name, "cpu") for name in OP_NAMES}  # cpp (and the native ops it reuses)
    assert ops and all(fn in resolved for fn in ops)
    assert model_op(model, "linear_logp") is get_op("linear_logp", "cpu")
    model.to("meta")
    with pytest.raises(RuntimeError, match="patched for 'cpu' .* but now runs on meta"):
        model(torch.zeros(1, 4, dtype=torch.long, device="meta"))


def test_model_on_several_device_types_is_refused():
    model = _model("tiny-llama", patched=False)
    model.lm_head.to("meta")
    with pytest.raises(ValueError, match="several device types"):
        apply_batch_invariant(model)


@pytest.mark.triton
def test_explicit_triton_backend_on_cpu_under_the_interpreter():
    model = _model("tiny-llama", patched=False)
    handle = apply_batch_invariant(model, backend="triton")
    assert handle.backend == "triton" and handle.layout.kv_block == 32  # interpreter tiles
    assert model.config._attn_implementation == attention_name("triton")
    assert model_op(model, "lm_head").__module__ == "rl_engine.kernels.triton.lm_head"
    with pytest.raises(ValueError, match="already patched with backend 'triton'"):
        apply_batch_invariant(model, backend="native")
    handle.revert()
    assert apply_batch_invariant(model, backend="native").backend == "native"


def test_optimizer_built_before_patching_still_trains_the_model():
    model = _model("tiny-llama", patched=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    apply_batch_invariant(model)
    ids = torch.randint(3, 999, (2, 8))
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    token_logprobs(model, ids).sum().backward()
    opt.step()
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_independent_of_batch_and_padding(name, dtype, temperature):
    model = _model(name, dtype)
    seqs = random_sequences(model.config.vocab_size, [23, 5, 17, 40, 2, 31])
    with torch.no_grad():
        alone = [token_logprobs(model, s[None], temperature=temperature)[0] for s in seqs]
        for side in ("left", "right"):
            for group in (seqs, seqs[2:5], seqs[::-1]):
                ids, mask = pad_sequences(group, side)
                got = unpad_logprobs(
                    token_logprobs(model, ids, mask, temperature=temperature), group, side
                )
                for s, lp in zip(group, got):
                    ref = alone[next(i for i, t in enumerate(seqs) if t is s)]
                    assert torch.equal(lp, ref), f"{side} padding, batch of {len(group)}"


def test_token_logprobs_shape_masking_and_accuracy():
    model = _model("tiny-llama")
    plain = _model("tiny-llama", patched=False)
    seqs = random_sequences(1000, [12, 7])
    ids, mask = pad_sequences(seqs, "left")
    with torch.no_grad():
        ours = token_logprobs(model, ids, mask)
        logits = plain(
            ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
    assert ours.shape == (2, 11) and ours.dtype == torch.float32
    assert torch.equal(ours[1, :5], torch.zeros(5))  # padding context or target
    ref = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(
        ours[mask[:, 1:].bool() & mask[:, :-1].bool()],
        ref[mask[:, 1:].bool() & mask[:, :-1].bool()].float(),
        atol=1e-4,
        rtol=0,
    )


def test_token_logprobs_never_calls_the_lm_head_module():
    model = _model("tiny-llama")

    def forbid(*_):
        raise AssertionError("lm_head module was called: full logits materialised")

    model.lm_head.register_forward_hook(forbid)
    token_logprobs(model, torch.randint(3, 999, (2, 6)))


# A 1-layer Llama whose (B, T, V) logits dwarf everything else it allocates: 4 x 1025 tokens
# x 32768 words of fp32 logits are 537 MB, its weights and activations a few MB. One fresh
# process measures token_logprobs first (nothing large was ever allocated before it), then the
# plain forward: memory the allocator kept from the first could only lower the second's peak,
# so the negative control cannot pass by it.
_PEAK_MEMORY_PROBE = """
import json, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from rl_engine.logprobs import token_logprobs
from rl_engine.patching import apply_batch_invariant
torch.manual_seed(0)
config = LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config).eval()
apply_batch_invariant(model)
ids = torch.randint(0, 32768, (4, 1025))
peaks = {}
with torch.no_grad():
    token_logprobs(model, ids[:, :16])  # first-call allocations are not the op's peak
    for case, call in [("token_logprobs", lambda: token_logprobs(model, ids)),
                       ("forward", lambda: model(ids).logits)]:
        reset_peak_rss()
        before = current_rss_bytes()
        call()
        peaks[case] = peak_rss_bytes() - before
print(json.dumps(peaks))
"""


def _peak_extra_bytes() -> dict[str, int]:
    """{"token_logprobs": bytes, "forward": bytes}: each call's peak RSS above the RSS before it."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_MEMORY_PROBE], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
def test_token_logprobs_never_materialises_full_logits():
    """Peak RSS while scoring stays far below the (B, T-1, V) fp32 logits; the plain forward,
    which does materialise them (the negative control), reaches at least their size.

    Measured in a fresh process (VmHWM reset just before each call), so any tensor of that size,
    whatever op allocates it, shows up."""
    full_logits = 4 * 1024 * 32768 * 4
    peaks = _peak_extra_bytes()
    plain, fused = peaks["forward"], peaks["token_logprobs"]
    assert plain >= full_logits, f"the probe missed the plain forward's logits: {plain} bytes"
    assert fused < full_logits // 2, f"token_logprobs peaked at {fused} extra bytes"


def test_token_logprobs_bad_input():
    model = _model("tiny-llama")
    with pytest.raises(
        ValueError, match="token ids out of range: min 3, max 1000, but the vocabulary size is 1000"
    ):
        token_logprobs(model, torch.tensor([[3, 1000]]))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        token_logprobs(model, torch.tensor([[3]]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        token_logprobs(model, torch.tensor([[3, 4]]), torch.ones(1, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_control_unpatched_model_depends_on_the_batch(dtype, capsys):
    plain = _model("tiny-llama", dtype, patched=False)
    seqs = random_sequences(1000, [23, 5, 17, 40, 2, 31])
    with torch.no_grad():
        alone = [token_logprobs(plain, s[None])[0] for s in seqs]
        ids, mask = pad_sequences(seqs, "left")
        batched = unpad_logprobs(token_logprobs(plain, ids, mask), seqs, "left")
    same = sum(int((a == b).sum()) for a, b in zip(alone, batched))
    total = sum(a.numel() for a in alone)
    with capsys.disabled():
        print(
            f"\n[negative control] unpatched tiny-llama {dtype}: {same}/{total} tokens bitwise equal alone vs batched"
        )
    assert same < total


@pytest.mark.multiprocess
@pytest.mark.threads
def test_token_logprobs_thread_count_invariance():
    code = """
    from rl_engine.models import load_model
    from rl_engine.patching import apply_batch_invariant
    from rl_engine.logprobs import token_logprobs
    result = {}
    for name in ["tiny-llama", "tiny-qwen3"]:
        for dtype in [torch.float32, torch.bfloat16]:
            model, _ = load_model(name, dtype=dtype, seed=0)
            apply_batch_invariant(model)
            ids = torch.randint(3, 999, (3, 70), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                result[f"{name}-{dtype}"] = token_logprobs(model, ids, temperature=0.7)
    """
    assert_equal_across_threads(code)
