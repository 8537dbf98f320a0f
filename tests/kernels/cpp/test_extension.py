"""The cpp backend's own promises: every instruction-set path and thread count gives the same bits.

Chain checked, for linear / lm_head, silu and attention: op on path P with T
threads == op on the default path with 1 thread, for every path P this CPU
runs (RL_ENGINE_CPU_ISA) and T in {1, 2, 4}; a row computed alone (M = 1,
a decode query) == the same row inside a large batch (M = 4096, a prefill).
The batch/padding/decode-prefill invariance of each op is checked by the op
tests (test_linear.py, test_attention.py, ...), which resolve `get_op(name,
"cpu")` to this backend. Negative controls: plain torch breaks the same
equalities (F.linear, F.silu), and the bf16 paths do differ on subnormals,
which is why the bf16 dot flavour is a parity fact.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import rl_engine.kernels.cpp._extension as cpp_extension
from rl_engine.kernels import get_op, kernel_facts
from tests.helpers.invariance import run_with_threads

ISAS = list(cpp_extension.ISA_PATHS)


def _supported(isa):
    if isa not in cpp_extension.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")


@pytest.fixture
def isa_path(request, monkeypatch):
    _supported(request.param)
    monkeypatch.setenv(cpp_extension.ISA_ENV, request.param)
    return request.param


# ----------------------------------------------------------------------------- one process

THREAD_COUNTS = (1, 2, 4)

# `ops()` per thread count in one process: the kernels read torch's thread count on every call
# (at::get_num_threads() sizes their at::parallel_for splits and scratch), so
# torch.set_num_threads between calls changes how they split the work, as a new process would.
OPS_CODE = """
import os
from rl_engine.kernels import get_op
linear, lm_head = get_op("linear", "cpu"), get_op("lm_head", "cpu")
silu, attention = get_op("silu", "cpu"), get_op("attention", "cpu")


def ops():
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(300, 1100, generator=g).to(dtype)
        w = (torch.randn(530, 1100, generator=g) / 33).to(dtype)
        out[f"linear{dtype}"] = linear(x, w)
        out[f"lm_head{dtype}"] = lm_head(x[:37], w)
        out[f"silu{dtype}"] = silu(torch.randn(333, 1001, generator=g).to(dtype) * 4)
        q = torch.randn(2, 6, 150, 40, generator=g).to(dtype)
        k, v = (torch.randn(2, 2, 150, 40, generator=g).to(dtype) for _ in range(2))
        positions = torch.arange(150).expand(2, 150)
        out[f"attention{dtype}"] = attention(q, k, v, q_positions=positions)
        decode_pos = torch.tensor([[149], [70]])  # one query block per sequence: keys packed per task
        qd = torch.stack([q[0, :, 149:], q[1, :, 70:71]])
        out[f"attention_decode{dtype}"] = attention(qd, k, v, q_positions=decode_pos)
    return out


result = {}
for threads in THREADS:
    torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    result[threads] = ops()
"""


def _ops_on(isa: str | None, threads: tuple[int, ...]) -> dict[int, dict]:
    """{thread count: {op and dtype: output}} of one new process on path `isa` (None: default)."""
    env = "" if isa is None else f"os.environ['{cpp_extension.ISA_ENV}'] = '{isa}'\n"
    code = f"import os\n{env}THREADS = {threads!r}\n{OPS_CODE}"
    return run_with_threads(code, threads[0], fresh=True)


@functools.cache
def _default_path_one_thread() -> dict:
    return _ops_on(None, (1,))[1]


@pytest.mark.multiprocess
@pytest.mark.threads
@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_path_and_thread_count_gives_the_same_bits(isa):
    """A new process on path `isa` (the ISA is read at import) runs the ops with 1, 2 and 4
    threads; each == the default path with 1 thread (one process, shared by the paths)."""
    _supported(isa)
    reference = _default_path_one_thread()
    for threads, got in _ops_on(isa, THREAD_COUNTS).items():
        for key, value in reference.items():
            assert torch.equal(got[key], value), f"{key}: {isa} with {threads} threads differs"


@pytest.mark.parametrize("isa_path", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_equals_the_same_row_in_a_training_batch(isa_path, dtype):
    """M = 1 (decode) and M = 4096 (training) run the same kernel: no padding, same bits."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 576, generator=g).to(dtype)
    w = (torch.randn(96, 576, generator=g) / 24).to(dtype)
    linear = get_op("linear", "cpu")
    full = linear(x, w)
    for row in (0, 1, 7, 4095):
        assert torch.equal(linear(x[row : row + 1], w)[0], full[row])


def test_negative_control_plain_torch_is_not_row_or_position_invariant():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 1024, generator=g)
    w = torch.randn(512, 1024, generator=g) / 32
    full = F.linear(x, w)
    assert not all(torch.equal(F.linear(x[i : i + 1], w)[0], full[i]) for i in range(8))
    # F.silu: a value alone takes the scalar tail code, in a long tensor the SIMD body
    v = torch.randn(4096, generator=g)
    alone = torch.cat([F.silu(v[i : i + 1]) for i in range(0, 4096, 4)])
    assert not torch.equal(alone, F.silu(v)[::4])


@pytest.mark.parametrize("isa_path", ISAS, indirect=True)
def test_silu_is_position_invariant_and_accurate(isa_path):
    silu = get_op("silu", "cpu")
    g = torch.Generator().manual_seed(3)
    v = torch.randn(4099, generator=g) * 6
    full = silu(v)
    for s in range(1, 16):
        assert torch.equal(silu(v[s:])[: 64 - s], full[s:64])
    assert torch.equal(torch.cat([silu(v[i : i + 1]) for i in range(0, 4096, 4)]), full[:4096:4])
    assert torch.allclose(full.double(), F.silu(v.double()), rtol=2e-7, atol=1e-7)
    vb = v.bfloat16()
    expected = F.silu(vb.double()).bfloat16()  # one rounding of a near-exact value
    assert (silu(vb).float() - expected.float()).abs().max() <= 2**-7 * expected.float().abs().max()


def test_bf16_dot_flavours_differ_only_by_subnormal_flushing():
    """VDPBF16PS flushes subnormals, its FMA emulation does not: why the flavour is a parity fact."""
    if "avx512_bf16" not in cpp_extension.supported_isas():
        pytest.skip("no VDPBF16PS on this CPU")
    ext = cpp_extension.extension()
    tiny = torch.full((1, 64), 2.0**-130).bfloat16()  # subnormal in bf16 and fp32
    one = torch.ones(3, 64).bfloat16()
    assert torch.equal(ext.gemm(tiny, one, "avx512_bf16"), torch.zeros(1, 3))
    assert bool((ext.gemm(tiny, one, "avx512") > 0).all())
    g = torch.Generator().manual_seed(4)
    x, w = (torch.randn(50, 300, generator=g).bfloat16() for _ in range(2))
    assert torch.equal(ext.gemm(x, w, "avx512_bf16"), ext.gemm(x, w, "avx512"))


def test_kernel_facts_name_the_numerics():
    facts = kernel_facts("cpu")
    assert facts["backend"] == "cpp"
    assert facts["cpp_numerics"] == cpp_extension.NUMERICS_VERSION
    assert facts["cpp_bf16_dot"] == cpp_extension.bf16_dot_flavour(cpp_extension.current_isa())
    assert kernel_facts("cpu", backend="native")["backend"] == "native"


def test_isa_switch_rejects_unknown_and_unsupported_paths(monkeypatch):
    monkeypatch.setenv(cpp_extension.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="RL_ENGINE_CPU_ISA='sse2' is unknown; known paths"):
        get_op("linear", "cpu")(torch.ones(1, 4), torch.ones(2, 4))
    unsupported = [isa for isa in ISAS if isa not in cpp_extension.supported_isas()]
    if unsupported:
        monkeypatch.setenv(cpp_extension.ISA_ENV, unsupported[0])
        with pytest.raises(ValueError, match="is not supported by this CPU"):
            get_op("linear", "cpu")(torch.ones(1, 4), torch.ones(2, 4))


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-rl-engine")
    with pytest.raises(RuntimeError, match="need a C\\+\\+ compiler, but 'no-such-compiler"):
        cpp_extension._compiler()


# ----------------------------------------------------------------------------- GEMM numerics


def _serial_chain_reference(x, w):
    """The specified order, emulated in float64 (exact products, one rounding to fp32 per add).

    fp32: acc = fma(x[m, k], w[n, k], acc) for k = 0, 1, ...; bf16: per pair, the odd
    element's product first, then the even one's (VDPBF16PS), odd K padded with zeros.
    A float64 add of an exact product and an fp32 value, then rounded to fp32, is the
    fp32 FMA except for double-rounding ties, which random data does not hit.
    """
    xd, wd = x.double(), w.double()
    if x.dtype == torch.bfloat16 and x.shape[1] % 2:
        xd, wd = F.pad(xd, (0, 1)), F.pad(wd, (0, 1))
    order = range(xd.shape[1])
    if x.dtype == torch.bfloat16:
        order = [k + 1 - 2 * (k % 2) for k in order]  # 1, 0, 3, 2, ...
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in order:
        acc = (torch.outer(xd[:, k], wd[:, k]) + acc.double()).float()
    return acc


@pytest.mark.parametrize("isa_path", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_is_the_serial_k_chain(isa_path, dtype):
    g = torch.Generator().manual_seed(5)
    ext = cpp_extension.extension()
    for m, n, k in ((1, 1, 1), (2, 19, 37), (3, 17, 5), (7, 70, 33), (13, 65, 40)):
        x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
        assert torch.equal(ext.gemm(x, w, isa_path), _serial_chain_reference(x, w)), (m, n, k)


# (K, N): K not a multiple of 16/32 (nor of the K block), N not a multiple of the 64-column panel
GEMM_SHAPES = [(1, 1), (17, 15), (33, 65), (1000, 2817), (600, 130)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_m_rows_equal_large_m_rows(dtype):
    """Decode-sized calls (unpacked tasks) give the rows of training-sized calls (packed blocks)."""
    g = torch.Generator().manual_seed(6)
    ext, isa = cpp_extension.extension(), cpp_extension.current_isa()
    for k, n in GEMM_SHAPES:
        big = 300 if k * n > 1e5 else 4096
        x = torch.randn(big, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        full = ext.gemm(x, w, isa)
        for m in (1, 2, 3, 8, 16, 17, 65):
            for start in (0, big - m, 101):
                got = ext.gemm(x[start : start + m], w, isa)
                assert torch.equal(got, full[start : start + m]), (k, n, m, start)
        assert torch.equal(ext.gemm(x[:300], w, isa), full[:300])


def test_isa_paths_agree_on_odd_shapes():
    """fp32: every path the same bits; bf16: the FMA emulations (avx512, avx2) the same bits."""
    paths = cpp_extension.supported_isas()
    ext = cpp_extension.extension()
    g = torch.Generator().manual_seed(7)
    for k, n in GEMM_SHAPES[:4]:
        for m in (1, 17, 100):
            x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
            ref = ext.gemm(x, w, paths[0])
            for isa in paths[1:]:
                assert torch.equal(ext.gemm(x, w, isa), ref), (isa, m, n, k)
            xb, wb = x.bfloat16(), w.bfloat16()
            emulated = [isa for isa in paths if isa != "avx512_bf16"]
            ref = ext.gemm(xb, wb, emulated[0])
            for isa in emulated[1:]:
                assert torch.equal(ext.gemm(xb, wb, isa), ref), (isa, m, n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_accuracy_against_float64(dtype):
    """Error of a serial fp32 chain: within a few ulp * sqrt(K) of sum |x w| (random signs)."""
    g = torch.Generator().manual_seed(8)
    ext, isa = cpp_extension.extension(), cpp_extension.current_isa()
    for k in (17, 1000, 4099):
        x, w = torch.randn(40, k, generator=g).to(dtype), torch.randn(70, k, generator=g).to(dtype)
        ref = x.double() @ w.double().T
        scale = x.double().abs() @ w.double().abs().T
        err = (ext.gemm(x, w, isa).double() - ref).abs()
        assert bool((err <= 4 * 2.0**-24 * k**0.5 * scale).all()), (dtype, k)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN equals any NaN (torch's own NaN payloads vary by path)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    return torch.equal(a[~nan], b[~nan])


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_fused_output_rounding_and_bias_equal_the_unfused_steps(in_dtype):
    """gemm(out fp32 / bf16, with / without bias) == gemm fp32 -> .to(out) -> + bias.to(out), every path.

    K = 600 spans two K blocks (the fp32 accumulators of a bf16 output are kept in
    scratch between them); M = 300 takes the large-M tasks, M <= 7 the small ones.
    """
    ext = cpp_extension.extension()
    g = torch.Generator().manual_seed(11)
    for isa in cpp_extension.supported_isas():
        for m in (1, 2, 7, 300):
            for n in (1, 17, 100):
                for k in (1, 33, 600):
                    x = torch.randn(m, k, generator=g).to(in_dtype)
                    w = (torch.randn(n, k, generator=g) / k**0.5).to(in_dtype)
                    bias = torch.randn(n, generator=g)
                    y = ext.gemm(x, w, isa)
                    for out in (torch.float32, torch.bfloat16):
                        ob = out == torch.bfloat16
                        assert torch.equal(ext.gemm(x, w, isa, out_bf16=ob), y.to(out))
                        want = y.to(out) + bias.to(out)
                        got = ext.gemm(x, w, isa, bias.to(out), out_bf16=ob)
                        assert got.dtype == out and torch.equal(got, want), (isa, m, n, k, out)


def test_fused_bf16_rounding_equals_torch_on_ties_inf_nan_subnormals():
    """acc -> bf16 in the kernel == torch's .to(bfloat16): ties (even / odd), inf, NaN, subnormals, overflow."""
    g = torch.Generator().manual_seed(12)
    bits = [
        torch.randint(-(2**31), 2**31, (5000,), generator=g, dtype=torch.int64),  # any pattern
        torch.randint(0, 2**15, (500,), generator=g, dtype=torch.int64) << 16 | 0x8000,  # ties
        torch.randint(0, 2**15, (500,), generator=g, dtype=torch.int64) << 16 | 0x7FFF,
        torch.randint(0, 2**15, (500,), generator=g, dtype=torch.int64) << 16 | 0x8001,
        torch.randint(0, 2**23, (500,), generator=g, dtype=torch.int64),  # subnormals
        torch.tensor([0, 1, 0x8000, 0x7FFF, 0x18000, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000]),
        torch.tensor([0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x80000000, 0x807FFFFF]),
    ]
    raw = torch.cat(bits) & 0xFFFFFFFF
    vals = torch.where(raw >= 2**31, raw - 2**32, raw).to(torch.int32).view(torch.float32)
    # K = 1 and w = 1: acc = fma(x, 1, +0) = x, except -0 -> +0 (sign of the +0 start): fine, the
    # reference is the kernel's own fp32 result.
    x = torch.cat([vals, vals.neg()]).reshape(-1, 1)
    w = torch.ones(19, 1)
    bias = torch.randn(19, generator=g).bfloat16()
    ext = cpp_extension.extension()
    for isa in cpp_extension.supported_isas():
        for rows in (x, x[:1], x[:2], x[5:11]):  # large-M tasks and the M <= 2 register path
            y = ext.gemm(rows, w, isa)
            assert _same_bits(ext.gemm(rows, w, isa, out_bf16=True), y.bfloat16()), isa
            assert _same_bits(ext.gemm(rows, w, isa, bias, out_bf16=True), y.bfloat16() + bias), isa
            assert _same_bits(ext.gemm(rows, w, isa, bias.float()), y + bias.float()), isa
