"""The update a worker takes, chosen once from `trainer.layout_invariant`, and the protocol
both updates implement."""

from __future__ import annotations

import inspect

from rl_engine.executors.worker.layout_free.update import LayoutFreeUpdate
from rl_engine.executors.worker.optim.adamw import adamw
from rl_engine.executors.worker.optim.layout_free_adamw import LayoutFreeAdamW
from rl_engine.executors.worker.step.update import PlainUpdate, Update, update_kind
from tests.helpers.worker.cell import cell_config


def test_the_config_key_picks_the_update_and_its_optimizer():
    plain = update_kind(cell_config(0, 1, "float32"))
    free = update_kind(cell_config(0, 1, "float32", trainer={"layout_invariant": True}))
    assert plain is PlainUpdate and plain.make_optimizer is adamw and not plain.layout_free
    assert free is LayoutFreeUpdate and free.make_optimizer is LayoutFreeAdamW and free.layout_free
    assert free.loss_scale is None  # exact per-token weights, never DeepSpeed's averages


def test_both_updates_implement_every_method_of_the_protocol():
    methods = {
        name
        for name, member in inspect.getmembers(Update, inspect.isfunction)
        if not name.startswith("_")
    }
    assert methods == {
        "new_step",
        "start",
        "route_micro_batch",
        "finish",
        "stepped",
        "empty_sums",
        "totals",
    }
    for kind in (PlainUpdate, LayoutFreeUpdate):
        for name in methods:
            ours = inspect.signature(getattr(kind, name)).parameters
            theirs = inspect.signature(getattr(Update, name)).parameters
            assert list(ours) == list(theirs), (kind.__name__, name)
