"""DeepSpeed's Muon probe, answered without importing Muon.

`deepspeed.initialize` (its ZeRO optimizer check) and ZeRO-3's optimizer ask whether the
client optimizer is DeepSpeed's `MuonWithAuxAdam` by importing its module, and that import
decorates Muon's kernels with `torch.compile`, which imports torch's inductor. Measured on a
2-core Xeon (docs/platform-facts.md): 1.3 s of CPU and 42 MB of resident memory in every
ZeRO rank's start, for an optimizer rl_engine never builds (its updates own their AdamW).
`skip_muon_probe` puts a stand-in module in its place before DeepSpeed asks, so the answer is
"not Muon" and the inductor is never imported. A process that imported DeepSpeed's Muon
before keeps it.
"""

from __future__ import annotations

import sys
import types

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


class MuonWithAuxAdam:
    """Stands in for DeepSpeed's Muon in rl_engine's ranks: an isinstance check says no, and
    building one says why instead of running a different optimizer."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "DeepSpeed's MuonWithAuxAdam is not available in an rl_engine training rank: "
            "rl_engine.executors.worker.deepspeed_muon stands in for it (rl_engine's updates "
            "build their own AdamW)"
        )


def skip_muon_probe() -> bool:
    """Install the stand-in unless DeepSpeed's own Muon module is already imported; True when
    the stand-in is (now) what DeepSpeed's import finds."""
    if MUON_MODULE not in sys.modules:
        stand_in = types.ModuleType(MUON_MODULE, __doc__)
        stand_in.MuonWithAuxAdam = MuonWithAuxAdam
        sys.modules[MUON_MODULE] = stand_in
    return getattr(sys.modules[MUON_MODULE], "MuonWithAuxAdam", None) is MuonWithAuxAdam
