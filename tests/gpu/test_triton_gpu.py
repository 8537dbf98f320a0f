"""The Triton backend on a real GPU, at realistic sizes (run by scripts/gpu_check.sh).

Same chains as the interpreter tests, with the compiled kernels and bf16 tiles
on the tensor cores, always torch.equal:
- matmul rows: M = 1 .. 8192 rows of a 4096 x 4096 projection; lm_head logits;
- rms_norm / log_softmax rows at H = 4096 / V = 151936;
- attention: decode from a KV cache (kv_index) == prefill row, across KV splits;
  a left-padded batch (k_positions) == the sequence alone;
- linear_logp == lm_head + log_softmax (fused == unfused);
- the whole chain on randomly initialised Llama / Qwen3 models of realistic
  width in bf16, and on a Qwen2.5-0.5B-shaped Qwen2 (vocab 151936, 24 layers):
  rollout-engine logprobs == teacher-forced token_logprobs;
- accuracy of the rounding the kernels use on a GPU (ex2.approx exp, IEEE
  division and square root), against fp64 at stated tolerances.
Negative controls: cuBLAS (F.linear) rows change with M, SDPA decode != its
prefill row, the unpatched model's recompute != the engine's logprobs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEV = "cuda"


def op(name):
    from rl_engine.kernels import get_op

    return get_op(name, DEV)  # cuda -> triton, no backend named


def _randn(*shape, dtype=torch.bfloat16, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def test_cuda_resolves_to_the_triton_backend():
    from rl_engine.kernels import resolve_backend

    assert resolve_backend(DEV) == "triton"
    assert op("linear").__module__ == "rl_engine.kernels.triton.linear"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_rows_do_not_depend_on_m(dtype):
    x = _randn(8192, 4096, dtype=dtype)
    w, b = _randn(4096, 4096, dtype=dtype, scale=4096**-0.5, seed=1), _randn(4096, dtype=dtype)
    full = op("linear")(x, w, b)
    for m in (1, 3, 64, 129, 1000):
        assert torch.equal(op("linear")(x[:m], w, b), full[:m]), f"M = {m}"
    perm = torch.randperm(8192, device=DEV)
    assert torch.equal(op("linear")(x[perm], w, b), full[perm])
    ref = x[:64].double() @ w.double().t() + b.double()
    tol = (1e-4 if dtype == torch.float32 else 2e-2) * ref.abs().max().item()
    torch.testing.assert_close(full[:64].double(), ref, atol=tol, rtol=0)


def test_lm_head_rows_and_fp32_logits():
    h, w = _randn(2048, 2048), _randn(32000, 2048, scale=2048**-0.5, seed=1)
    full = op("lm_head")(h, w)
    assert full.dtype == torch.float32
    for m in (1, 7, 300):
        assert torch.equal(op("lm_head")(h[-m:], w), full[-m:]), f"M = {m}"


def test_negative_control_cublas_rows_change_with_m():
    x, w = _randn(8192, 4096), _randn(4096, 4096, scale=4096**-0.5, seed=1)
    full = F.linear(x, w)
    differs = [m for m in (1, 3, 64, 129) if not torch.equal(F.linear(x[:m], w), full[:m])]
    assert differs, "cuBLAS rows did not change with M for any M: the control is void here"


def test_rowwise_ops_rows_do_not_depend_on_the_batch():
    x, wn = _randn(4096, 4096), _randn(4096, seed=1)
    full = op("rms_norm")(x, wn, 1e-6)
    logits = _randn(512, 151936, dtype=torch.float32, scale=3.0)
    lsm = op("log_softmax")(logits, 0.7)
    for m in (1, 5, 300):
        assert torch.equal(op("rms_norm")(x[-m:], wn, 1e-6), full[-m:])
        assert torch.equal(op("log_softmax")(logits[-m:], 0.7), lsm[-m:])
    torch.testing.assert_close(
        lsm.double(), torch.log_softmax(logits.double() / 0.7, -1), atol=1e-4, rtol=0
    )
    s = _randn(1 << 20)
    assert torch.equal(op("silu")(s[12345:12346]), op("silu")(s)[12345:12346])


def _seq(n, hq=32, hkv=8, d=128, seed=0):
    return tuple(_randn(h, n, d, seed=seed + i) for i, h in enumerate((hq, hkv, hkv)))


def _alone(attend, seq):
    q, k, v = seq
    pos = torch.arange(q.shape[1], device=DEV)[None]
    return attend(q[None], k[None], v[None], q_positions=pos)[0]


def test_attention_decode_equals_prefill_across_kv_splits():
    attend = op("attention")
    seqs = [_seq(2100), _seq(700, seed=5)]
    alone = [_alone(attend, s) for s in seqs]
    cap = 2176
    kc = torch.zeros((4, 8, cap, 128), dtype=torch.bfloat16, device=DEV)
    vc = torch.zeros_like(kc)
    slot_of = [2, 0]
    for s, (_, k, v) in zip(slot_of, seqs):
        kc[s, :, : k.shape[1]], vc[s, :, : v.shape[1]] = k, v
    rows = [(0, 0), (0, 1023), (0, 1024), (0, 2047), (0, 2099), (1, 699), (1, 64)]
    q = torch.stack([seqs[b][0][:, p] for b, p in rows])[:, :, None]
    qpos = torch.tensor([[p] for _, p in rows], device=DEV)
    kv_index = torch.tensor([slot_of[b] for b, _ in rows], device=DEV)
    out = attend(q, kc, vc, q_positions=qpos, kv_index=kv_index)
    for i, (b, p) in enumerate(rows):
        assert torch.equal(out[i, :, 0], alone[b][:, p]), (b, p)
    ref_q, ref_k, ref_v = (t[None].float() for t in seqs[1])
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(alone[1].float(), ref[0], atol=2e-2, rtol=2e-2)


def test_attention_left_padded_batch_equals_alone():
    attend = op("attention")
    seqs = [_seq(300, seed=1), _seq(1100, seed=2)]
    alone = [_alone(attend, s) for s in seqs]
    total = 1100
    q = _randn(2, 32, total, 128, seed=9) * 100
    k, v = _randn(2, 8, total, 128, seed=10) * 100, _randn(2, 8, total, 128, seed=11) * 100
    pos = torch.full((2, total), -1, dtype=torch.long, device=DEV)
    for b, (sq, sk, sv) in enumerate(seqs):
        n = sq.shape[1]
        q[b, :, total - n :], k[b, :, total - n :], v[b, :, total - n :] = sq, sk, sv
        pos[b, total - n :] = torch.arange(n, device=DEV)
    out = attend(q, k, v, q_positions=pos, k_positions=pos)
    for b, s in enumerate(seqs):
        assert torch.equal(out[b, :, total - s[0].shape[1] :], alone[b])


def test_negative_control_sdpa_decode_differs_from_its_prefill():
    q, k, v = (t[None] for t in _seq(2100))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    differs = [
        p
        for p in (1023, 2099)
        if not torch.equal(
            F.scaled_dot_product_attention(
                q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], enable_gqa=True
            ),
            full[:, :, p : p + 1],
        )
    ]
    assert differs, "SDPA decode matched its prefill rows: the control is void here"


def test_linear_logp_fused_equals_unfused():
    h, w = _randn(2048, 2048), _randn(32000, 2048, scale=2048**-0.5, seed=1)
    t = torch.randint(0, 32000, (2048,), device=DEV)
    fused = op("linear_logp")(h, w, t, temperature=0.7)
    unfused = op("log_softmax")(op("lm_head")(h, w), 0.7).gather(-1, t[:, None])[:, 0]
    assert torch.equal(fused, unfused)
    assert torch.equal(op("linear_logp")(h[:1], w, t[:1], temperature=0.7), fused[:1])


# ----------------------------------------------------------------------------- whole chain


def _qwen2_0p5b_config():
    """Qwen2.5-0.5B's shape (494 M parameters), randomly initialised."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
        attn_implementation="sdpa",
    )


def _realistic(family: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if family == "qwen2_0p5b":
        torch.manual_seed(0)
        with torch.device(DEV):
            return AutoModelForCausalLM.from_config(_qwen2_0p5b_config(), dtype=torch.bfloat16)

    common = dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=4,
        num_attention_heads=16,
        head_dim=128,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    if family == "llama":
        config = LlamaConfig(num_key_value_heads=4, tie_word_embeddings=False, **common)
    else:
        config = Qwen3Config(
            num_key_value_heads=8, tie_word_embeddings=True, use_sliding_window=False, **common
        )
    torch.manual_seed(0)
    with torch.device(DEV):  # initialised on the GPU: seconds, not a CPU init of 0.6 B weights
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_0p5b"])
def test_rollout_logprobs_equal_recompute_on_a_realistic_model(family):
    from rl_engine.patching import apply_batch_invariant
    from rl_engine.rollout import RolloutEngine, SamplingParams
    from tests.helpers.rollout.common import assert_parity, random_prompts, recompute_padded

    model = _realistic(family)  # on the GPU first, then patched: ops resolved for cuda
    handle = apply_batch_invariant(model)
    assert handle.backend == "triton"
    engine = RolloutEngine(model, device=DEV, max_batch_size=4, progress=False)
    real_size = family == "qwen2_0p5b"  # the real vocabulary and depth: fewer, shorter rollouts
    sampling = SamplingParams(max_new_tokens=24 if real_size else 48, temperature=0.8, seed=1)
    lengths = (17, 300, 5, 64) if real_size else (17, 300, 5, 64, 129, 33)
    prompts = random_prompts(model.config.vocab_size, lengths, seed=2)
    completions = engine.generate(prompts, sampling)
    padded = recompute_padded(model, completions, sampling.logprob_temperature, "left")
    assert_parity(completions, padded, f"{family} bf16 on cuda")

    handle.revert()  # negative control: the plain model's recompute does not match
    plain = recompute_padded(model, completions, sampling.logprob_temperature, "left")
    assert not all(torch.equal(c.logprobs, p) for c, p in zip(completions, plain))


# ----------------------------------------------------------------------------- rounding accuracy
# On a GPU, tl.exp is ex2.approx.f32 (and log lg2.approx): the kernels' bits are their own,
# not torch's. These bound the difference from the fp64 formula.


def test_log_softmax_accuracy_against_fp64():
    x = _randn(64, 151936, dtype=torch.float32, scale=4.0)
    got = op("log_softmax")(x, 0.7).double()
    ref = torch.log_softmax(x.double() / 0.7, dim=-1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_accuracy_against_fp64(dtype):
    x, w = _randn(256, 4096, dtype=dtype), _randn(4096, dtype=dtype, seed=1)
    got = op("rms_norm")(x, w, 1e-6).double()
    x64 = x.double()
    normed = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double()
    ref = (w.double() * normed).to(dtype).double()
    rtol = 2**-7 if dtype == torch.bfloat16 else 2e-6  # 1 bf16 ulp / a few fp32 ulp
    torch.testing.assert_close(got, ref, atol=0, rtol=rtol)


@pytest.mark.parametrize("name", ["silu", "sigmoid"])
def test_elementwise_accuracy_against_fp64(name):
    x = _randn(1 << 20, dtype=torch.float32, scale=8.0)
    ref = getattr(torch.nn.functional, name)(x.double())
    torch.testing.assert_close(op(name)(x).double(), ref, atol=1e-7, rtol=2e-6)
