"""The worker's AdamW stepping in blocks of elements: the bits of torch's AdamW, state and all."""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.optim import adamw as blockwise


def _pair(shape, monkeypatch, block: int = 64, weight_decay: float = 0.1):
    monkeypatch.setattr(blockwise, "ADAM_BLOCK_ELEMENTS", block)
    torch.manual_seed(0)
    start = torch.randn(shape)
    ours = torch.nn.Parameter(start.clone())
    theirs = torch.nn.Parameter(start.clone())
    return (
        ours,
        blockwise.adamw([ours], lr=1e-3, weight_decay=weight_decay),
        theirs,
        torch.optim.AdamW([theirs], lr=1e-3, weight_decay=weight_decay),
    )


def _steps(ours, ours_opt, theirs, theirs_opt, steps: int = 4):
    for step in range(steps):
        grad = torch.randn(ours.shape) * 10.0**step  # moments of several magnitudes
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        ours_opt.step()
        theirs_opt.step()


@pytest.mark.parametrize("threads", [1, 2])
# (100_003,): above torch's grain size, so 2 threads split the whole tensor and the blocks
# at different places
@pytest.mark.parametrize("shape", [(5,), (64 * 7 + 13,), (300, 17), (4096 * 3 + 1,), (100_003,)])
def test_blockwise_step_is_torch_adamw_bit_for_bit(shape, threads, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, ours_opt, theirs, theirs_opt = _pair(shape, monkeypatch)
        _steps(ours, ours_opt, theirs, theirs_opt)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ours_opt.state[ours][key], theirs_opt.state[theirs][key]), key


def test_bf16_parameters_and_no_weight_decay(monkeypatch):
    ours, ours_opt, theirs, theirs_opt = _pair((1000,), monkeypatch, weight_decay=0.0)
    ours.data, theirs.data = ours.data.bfloat16(), theirs.data.bfloat16()
    for step in range(3):
        grad = torch.randn(ours.shape, dtype=torch.bfloat16) * 10.0**step
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        ours_opt.step()
        theirs_opt.step()
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


def test_non_contiguous_parameter_is_stepped_whole(monkeypatch):
    ours, ours_opt, theirs, theirs_opt = _pair((40, 30), monkeypatch)
    ours.data, theirs.data = ours.data.t(), theirs.data.t()  # transposed views
    _steps(ours, ours_opt, theirs, theirs_opt)
    assert not ours.is_contiguous()
    assert torch.equal(ours, theirs)


def test_state_dict_has_torch_adamw_layout(monkeypatch):
    ours, ours_opt, theirs, theirs_opt = _pair((1000,), monkeypatch)
    _steps(ours, ours_opt, theirs, theirs_opt, steps=2)
    mine, reference = ours_opt.state_dict(), theirs_opt.state_dict()
    assert mine["param_groups"] == reference["param_groups"]
    assert mine["state"].keys() == reference["state"].keys()
    for index, state in reference["state"].items():
        assert sorted(mine["state"][index]) == sorted(state)
        for key, value in state.items():
            assert torch.equal(mine["state"][index][key], value), key
    # a reloaded optimizer goes on with the same bits
    again = torch.nn.Parameter(ours.detach().clone())
    reloaded = blockwise.adamw([again], lr=1e-3, weight_decay=0.1)
    reloaded.load_state_dict(mine)
    grad = torch.randn(ours.shape)
    again.grad, theirs.grad = grad.clone(), grad.clone()
    reloaded.step()
    theirs_opt.step()
    assert torch.equal(again, theirs)


def test_a_step_makes_temporaries_of_one_block_only(monkeypatch):
    """The update's allocations: one block's temporaries at a time, never the parameter's size."""
    ours, ours_opt, _, _ = _pair((1 << 16,), monkeypatch, block=1 << 10)
    ours.grad = torch.randn(ours.shape)
    ours_opt.step()  # the first step allocates the moments (parameter-sized, kept)
    ours.grad = torch.randn(ours.shape)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        ours_opt.step()
    sizes = [event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0]
    assert sizes, "the profiler saw no allocation"
    assert max(sizes) <= (1 << 10) * 4 * 2  # fp32 elements of a block, with slack for one more


def test_unsupported_options_fail_closed(monkeypatch):
    ours, ours_opt, _, _ = _pair((10,), monkeypatch)
    ours_opt.param_groups[0]["amsgrad"] = True
    ours.grad = torch.randn(ours.shape)
    with pytest.raises(ValueError, match="amsgrad"):
        ours_opt.step()
    with pytest.raises(ValueError, match="closure"):
        ours_opt.step(lambda: 0.0)


def test_on_cpu_the_step_is_blockwise():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = blockwise.adamw([param], lr=1e-3, weight_decay=0.0)
    assert type(optimizer) is torch.optim.AdamW  # DeepSpeed accepts it without untested-optimizer
    assert optimizer.step.func is blockwise._step_in_blocks


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 63, 64, 64 * 5 + 2])
def test_all_finite_checks_every_block(bad, where, monkeypatch):
    monkeypatch.setattr(blockwise, "ADAM_BLOCK_ELEMENTS", 64)
    values = torch.randn(64 * 5 + 3)
    assert blockwise.all_finite(values)
    values[where] = bad
    assert not blockwise.all_finite(values)
    assert not blockwise.all_finite(values.view(1, -1).t())  # any shape


def test_all_finite_of_an_empty_tensor():
    assert blockwise.all_finite(torch.zeros(0))
