"""What the cpp backend promises: its C++ kernels' dtypes on cpu tensors, and nothing silently else.

The C++ kernels compute fp32 and bf16. For fp64 and fp16:
- `silu` runs native's `x / (1 + exp(-x))`, row-invariant in every dtype (other bits
  than the cpp kernel's, but the same for every batch): served (`KERNELS`);
- `attention` runs native's forward, whose fixed-shape `torch.bmm` calls rest on
  native's platform assumption: served where native's probe accepts the dtype, else
  PlatformInvarianceError, as native's own attention (`ATTENTION`);
- the GEMM ops (`linear`, `lm_head`, `linear_logp`, `moe_router`, `moe_experts`) would
  run a padded, K-sliced torch GEMM (`_torch_gemm.py`) whose call shape follows the
  batch, so a row's bits may change with it: refused with NonInvariantDtypeError
  unless the caller opts in (`GEMM`).
Every op of this backend takes cpu tensors only (`check_device`).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.op import Serving
from rl_engine.kernels.native.platform_probe import platform_refusal

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on {t.device}: the cpp backend runs on cpu (resolve the op for "
            f"{t.device.type} with get_op(name, {t.device.type!r}))"
        )


KERNELS = Serving(backend="cpp", check_device=check_device)
GEMM = Serving(
    backend="cpp",
    invariant_dtypes=KERNEL_DTYPES,
    otherwise=(
        "a padded, K-sliced torch GEMM (cpp/_torch_gemm.py) whose kernel follows the batch "
        "size, so a row's bits may change with the batch"
    ),
    check_device=check_device,
)


def _native_forward_refusal(dtype: torch.dtype, device_type: str) -> str | None:
    """Native's probe decides for the dtypes cpp's attention hands to native's forward."""
    if dtype in KERNEL_DTYPES:
        return None
    reason = platform_refusal(dtype, device_type)
    if reason is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return f"backend 'cpp' runs native's attention forward for {name}: {reason}"


ATTENTION = Serving(
    backend="cpp", check_device=check_device, platform_refusal=_native_forward_refusal
)
