"""The worker's side of a weight sync into the engines (executors/worker/weights/engine_sync.py):
the manifest is the policy's tensors with each rank's range of the worker's world, sending
before joining the weight group is refused by name, and closing a sync that never connected is
a no-op (the multi-rank sync itself: tests/executors/worker/weights/
test_weight_transport.py and the job's weight-sync tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rl_engine.executors.worker.weights.engine_sync import EngineWeightSync


class _Worker(EngineWeightSync):
    """The attributes the mixin reads of `DeepSpeedTrainingWorker`, around a plain policy."""

    def __init__(self, policy: nn.Module, world_size: int):
        self.module = SimpleNamespace(policy=policy)
        self.zero_stage, self.world_size = 0, world_size


def test_the_manifest_lists_the_policys_tensors_split_over_the_worlds_ranks():
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    manifest = _Worker(policy, world_size=2).weight_manifest()
    assert manifest.num_senders == 2
    named = dict(policy.named_parameters())
    assert [spec.name for spec in manifest.tensors] == list(named)
    for spec in manifest.tensors:
        assert spec.shape == tuple(named[spec.name].shape)
        (_, middle), (lo, hi) = spec.sources
        assert middle == lo and hi == named[spec.name].numel()  # rank 1 goes on where 0 ends


def test_send_weights_before_connecting_is_refused():
    sync = EngineWeightSync()
    with pytest.raises(RuntimeError, match="send_weights before connect_weight_sync"):
        sync.send_weights()
    with pytest.raises(RuntimeError, match="send_weights before connect_weight_sync"):
        sync.send_weights(adapters_only=True)


def test_closing_a_sync_that_never_connected_does_nothing():
    sync = EngineWeightSync()
    sync.close_weight_sync()
    sync.close_weight_sync()
    assert sync._weight_sync is None
