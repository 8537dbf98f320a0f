"""The decode roofline (rl_engine/benchmarks/roofline.py): a tiny model's shape (its projections,
the weight bytes a step reads, the tied head counted once), a step's bytes and FLOPs by the
formula, and the limit: whichever of memory and compute takes longer."""

from __future__ import annotations

import pytest

from rl_engine.benchmarks.roofline import GB, ModelShape, Roofline, best_seconds
from rl_engine.models import load_model


def test_the_shape_of_a_tied_tiny_model():
    model, _ = load_model("tiny-llama")  # hidden 96, 6 heads of 16, 2 KV heads, tied head
    shape = ModelShape.of(model, patched=False)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (
        2,
        96,
        6,
        2,
        16,
    )
    assert sorted(shape.projections) == sorted(
        [(96, 96), (96, 32), (96, 32), (96, 96), (96, 200), (96, 200), (200, 96)]
    )
    params = sum(p.numel() for p in model.parameters())  # the tied embedding once
    assert shape.weight_bytes == 4 * params and shape.kv_bytes == 4
    per_layer = sum(i * o for i, o in shape.projections)
    assert shape.linear_weights == 2 * per_layer + 1000 * 96


def test_a_steps_bytes_and_flops():
    shape = ModelShape(2, 8, 2, 1, 4, ((8, 8),), weight_bytes=1000, linear_weights=64, kv_bytes=2)
    assert shape.step_bytes(batch=3, context=10) == 1000 + 3 * (2 * 2 * 1 * 4 * 10 * 2)
    assert shape.step_flops(batch=3, context=10) == 3 * (2 * 64 + 2 * 2 * 2 * 2 * 4 * 10)


@pytest.mark.parametrize(
    ("bandwidth", "peak", "bound"), [(1.0, 100.0, "memory"), (100.0, 1.0, "compute")]
)
def test_the_limit_is_the_slower_of_memory_and_compute(bandwidth, peak, bound):
    roof = Roofline(batch=4, step_bytes=2 * GB, bandwidth=bandwidth, step_flops=2 * GB, peak=peak)
    assert roof.bound == bound
    slower = max(roof.memory_seconds, roof.compute_seconds)
    assert roof.tokens_per_second == 4 / slower and roof.fraction(4 / slower) == 1.0


def test_best_seconds_warms_up_once_and_takes_the_best():
    calls = []
    assert best_seconds(lambda: calls.append(1), 3) >= 0 and len(calls) == 4
