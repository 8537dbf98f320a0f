"""The native backend's platform probe (native/platform_probe.py): it measures the tile GEMM's
assumption per dtype, names what failed, and the GEMM ops refuse only the dtype it refused.

The probe's refusal path cannot be reached on a real CPU that passes it, so it is checked with
fakes of the measured scheme: library schemes that break one assumption each, and a
measurement that reports a thread-count mismatch. The probe-level checks (its result, its
message, its helpers, that it restores the thread count) hold on every CPU, whatever the
verdict for each dtype is there.
"""

import pytest
import torch

import rl_engine.kernels.native.platform_probe as probe_module
from rl_engine.kernels import PlatformInvarianceError, get_op, kernel_facts
from tests.helpers.invariance import skip_if_refused
from tests.helpers.kernels.native_gemm import gemm_problem, with_threads

TILE = 64


@pytest.fixture
def fresh_probe():
    """The probe's per-process cache emptied before and after (the fakes' verdicts must not stay)."""
    probe_module.probe.cache_clear()
    yield probe_module
    probe_module.probe.cache_clear()


_tiled = probe_module.tiled_matmul  # the real scheme: row-wise where the probe accepts


def _other_order(x, w):
    # A correctly rounded product: differs from the library's fp32 sums in most rows.
    return (x.double() @ w.double().t()).to(torch.float32)


def _odd_rows_differ(x, w, *, out_dtype):
    out = _tiled(x, w, out_dtype=torch.float32)
    out[1::2] = _other_order(x[1::2], w)
    return out.to(out_dtype)


def _large_rows_change_their_tile(x, w, *, out_dtype):
    out = _tiled(x, w, out_dtype=torch.float32)
    for start in range(0, x.shape[0], TILE):
        if x[start : start + TILE].abs().max() > 100:
            out[start : start + TILE] = _other_order(x[start : start + TILE], w)
    return out.to(out_dtype)


def _one_thread_differs(x, w, *, out_dtype):
    if torch.get_num_threads() == 1:
        return _other_order(x, w).to(out_dtype)
    return _tiled(x, w, out_dtype=out_dtype)


def _odd_weight_address_differs(x, w, *, out_dtype):
    if w.storage_offset() % 2:
        return _other_order(x, w).to(out_dtype)
    return _tiled(x, w, out_dtype=out_dtype)


@pytest.mark.parametrize(
    "scheme,assumption",
    [
        (_odd_rows_differ, "row position"),
        (_large_rows_change_their_tile, "other rows"),
        (_one_thread_differs, "thread count"),
        (_odd_weight_address_differs, "weight address"),
    ],
)
def test_probe_names_the_assumption_a_scheme_breaks(monkeypatch, fresh_probe, scheme, assumption):
    """Each fake breaks one assumption on top of the real scheme; the probe names that one only."""
    skip_if_refused("native", torch.float32)  # the real scheme must pass for the base to be sound
    monkeypatch.setattr(fresh_probe, "tiled_matmul", scheme)
    result = fresh_probe.probe(torch.float32, "cpu")
    assert [name for name, _ in result.failures] == [assumption], result.failures
    assert result.outcome == f"refused: {assumption}"


def test_refusal_is_one_clear_error_for_that_dtype_only(monkeypatch, fresh_probe):
    """A measurement that reports a thread-count mismatch for fp32 refuses fp32; bf16 keeps working."""
    skip_if_refused("native", torch.bfloat16)
    real = fresh_probe._measure
    measured = []

    def mismatching_threads(x, w, threads=None):
        measured.append(x.dtype)
        out = real(x, w, threads)
        if x.dtype == torch.float32 and threads is not None:
            out = out.clone()
            out[5] = torch.nextafter(out[5], torch.full_like(out[5], float("inf")))
        return out

    monkeypatch.setattr(fresh_probe, "_measure", mismatching_threads)
    pool, w = gemm_problem(600, torch.float32)
    targets = torch.zeros(3, dtype=torch.long)
    for name, args in [
        ("linear", (pool[:3], w)),
        ("lm_head", (pool[:3], w)),
        ("linear_logp", (pool[:3], w, targets)),
        ("linear", (pool[:3], w)),  # again: the same error, from the cached verdict
    ]:
        with pytest.raises(PlatformInvarianceError) as err:
            get_op(name, "cpu", backend="native")(*args)
        message = str(err.value)
        assert "float32" in message and "intra-op thread count" in message, message
        assert "1 of 64 rows differ" in message and "backend 'cpp'" in message, message
    assert isinstance(err.value, RuntimeError)
    fp32_measurements = measured.count(torch.float32)
    assert fp32_measurements > 0

    bf16_pool, bf16_w = pool.bfloat16(), w.bfloat16()
    alone = get_op("linear", "cpu", backend="native")(bf16_pool[:1], bf16_w)
    assert torch.equal(get_op("linear", "cpu", backend="native")(bf16_pool, bf16_w)[:1], alone)
    assert measured.count(torch.float32) == fp32_measurements, "fp32 was measured twice"
    assert torch.equal(get_op("linear", "cpu")(pool[:3], w), get_op("linear", "cpu")(pool, w)[:3])

    facts = kernel_facts("cpu", backend="native")
    assert facts["native_fp32_platform"] == "refused: thread count"
    assert facts["native_bf16_platform"] == "invariant"


@pytest.mark.parametrize(
    "dtype,advice",
    [
        (torch.float32, "Use backend 'cpp' for float32"),
        (torch.bfloat16, "Use backend 'cpp' for bfloat16"),
        (
            torch.float64,
            "No backend here is row-invariant for float64",
        ),  # cpp's fp64 is a library GEMM
    ],
)
def test_refusal_advice_names_a_backend_only_where_one_holds_the_contract(dtype, advice):
    result = probe_module.ProbeResult(dtype, "cpu", (("row position", "rows reversed: 3 of 64"),))
    message = probe_module.refusal_message(result)
    assert advice in message and "rows reversed: 3 of 64" in message, message
    assert "position in the tile" in message, message


@pytest.mark.parametrize("threads", [1, 2])
def test_probe_restores_the_thread_count(fresh_probe, threads):
    def run():
        fresh_probe.probe(torch.float32, "cpu")
        return torch.get_num_threads()

    assert with_threads(threads, run) == threads


def test_kernel_facts_record_tile_slices_and_probe_outcome():
    facts = kernel_facts("cpu", backend="native")
    assert facts["backend"] == "native"
    assert (facts["native_tile_rows"], facts["native_fp32_k_slice"]) == ("64", "512")
    assert facts["native_bf16_k_slice"] == "256"
    for dtype in ("fp32", "bf16"):
        outcome = facts[f"native_{dtype}_platform"]
        assert outcome == "invariant" or outcome.startswith("refused: "), outcome
    assert kernel_facts("cpu", backend="native") == facts


# -- the probe's own pieces, on every CPU ----------------------------------------


def test_a_result_is_accepted_only_without_failures_and_names_every_failed_assumption():
    accepted = probe_module.ProbeResult(torch.float32, "cpu", ())
    assert accepted.accepted and accepted.outcome == "invariant"
    failures = (("other rows", "a"), ("thread count", "b"))
    refused = probe_module.ProbeResult(torch.bfloat16, "cpu", failures)
    assert not refused.accepted and refused.outcome == "refused: other rows, thread count"


def test_refusal_on_cuda_points_to_triton():
    result = probe_module.ProbeResult(torch.bfloat16, "cuda", (("weight address", "moved"),))
    message = probe_module.refusal_message(result)
    assert "bfloat16 on this cuda" in message and "Use backend 'triton'" in message, message
    assert "weight's address in memory: false here (moved)" in message, message


def test_require_invariant_platform_raises_exactly_where_the_probe_refuses():
    """Whatever this CPU's verdict: the check raises the probe's message, or passes."""
    for dtype in (torch.float32, torch.bfloat16):
        reason = probe_module.platform_refusal(dtype, "cpu")
        if reason is None:
            probe_module.require_invariant_platform(dtype, torch.device("cpu"))
            continue
        with pytest.raises(PlatformInvarianceError) as err:
            probe_module.require_invariant_platform(dtype, "cpu")
        assert str(err.value) == reason


def test_require_invariant_platform_names_a_refused_dtype(monkeypatch, fresh_probe):
    monkeypatch.setattr(fresh_probe, "tiled_matmul", _odd_weight_address_differs)
    with pytest.raises(PlatformInvarianceError, match="for float32 on this cpu"):
        fresh_probe.require_invariant_platform(torch.float32, "cpu")


def test_the_verdict_is_measured_once_per_dtype_and_device_type(fresh_probe):
    first = fresh_probe.probe(torch.float32, "cpu")
    assert fresh_probe.probe(torch.float32, "cpu") is first
    assert first.dtype == torch.float32 and first.device_type == "cpu"


def test_moved_weight_has_the_same_values_at_another_address():
    w = torch.randn(3, 5)
    moved = probe_module._moved(w)
    assert torch.equal(moved, w) and moved.storage_offset() == 1
    assert moved.data_ptr() != w.data_ptr()


def test_differ_counts_the_rows_that_differ():
    want = torch.zeros(4, 3)
    assert probe_module._differ(want.clone(), want, "case") == ""
    got = want.clone()
    got[1, 2] = got[3, 0] = 1e-30
    assert probe_module._differ(got, want, "case") == "case: 2 of 4 rows differ"
