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

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import get_op, kernel_facts
from rl_engine.kernels.cpp import _extension
from tests.invariance import run_with_threads

ISAS = list(_extension.ISA_PATHS)


def _supported(isa):
    if isa not in _extension.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")


@pytest.fixture
def isa_path(request, monkeypatch):
    _supported(request.param)
    monkeypatch.setenv(_extension.ISA_ENV, request.param)
    return request.param


# ----------------------------------------------------------------------------- one process

OPS_CODE = """
import os
from rl_engine.kernels import get_op
linear, lm_head = get_op("linear", "cpu"), get_op("lm_head", "cpu")
silu, attention = get_op("silu", "cpu"), get_op("attention", "cpu")
g = torch.Generator().manual_seed(0)
result = {}
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(300, 1100, generator=g).to(dtype)
    w = (torch.randn(530, 1100, generator=g) / 33).to(dtype)
    result[f"linear{dtype}"] = linear(x, w)
    result[f"lm_head{dtype}"] = lm_head(x[:37], w)
    result[f"silu{dtype}"] = silu(torch.randn(333, 1001, generator=g).to(dtype) * 4)
    q = torch.randn(2, 6, 150, 40, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 150, 40, generator=g).to(dtype) for _ in range(2))
    result[f"attention{dtype}"] = attention(q, k, v, q_positions=torch.arange(150).expand(2, 150))
    decode_pos = torch.tensor([[149], [70]])  # one query block per sequence: keys packed per task
    qd = torch.stack([q[0, :, 149:], q[1, :, 70:71]])
    result[f"attention_decode{dtype}"] = attention(qd, k, v, q_positions=decode_pos)
"""


def _ops_on(isa: str | None, threads: int) -> dict:
    env = "" if isa is None else f"os.environ['{_extension.ISA_ENV}'] = '{isa}'\n"
    return run_with_threads("import os\n" + env + OPS_CODE, threads)


@pytest.mark.multiprocess
@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_path_and_thread_count_gives_the_same_bits(isa):
    """Subprocesses: path `isa` with 1, 2 and 4 threads == the default path with 1 thread."""
    _supported(isa)
    reference = _ops_on(None, 1)
    for threads in (1, 2, 4):
        got = _ops_on(isa, threads)
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
    if "avx512_bf16" not in _extension.supported_isas():
        pytest.skip("no VDPBF16PS on this CPU")
    ext = _extension.extension()
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
    assert facts["cpp_numerics"] == _extension.NUMERICS_VERSION
    assert facts["cpp_bf16_dot"] == _extension.bf16_dot_flavour(_extension.current_isa())
    assert kernel_facts("cpu", backend="native")["backend"] == "native"


def test_isa_switch_rejects_unknown_and_unsupported_paths(monkeypatch):
    monkeypatch.setenv(_extension.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="RL_ENGINE_CPU_ISA='sse2' is unknown; known paths"):
        get_op("linear", "cpu")(torch.ones(1, 4), torch.ones(2, 4))
    unsupported = [isa for isa in ISAS if isa not in _extension.supported_isas()]
    if unsupported:
        monkeypatch.setenv(_extension.ISA_ENV, unsupported[0])
        with pytest.raises(ValueError, match="is not supported by this CPU"):
            get_op("linear", "cpu")(torch.ones(1, 4), torch.ones(2, 4))


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-rl-engine")
    with pytest.raises(RuntimeError, match="need a C\\+\\+ compiler, but 'no-such-compiler"):
        _extension._compiler()
