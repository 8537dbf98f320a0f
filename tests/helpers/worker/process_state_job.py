"""A run that leaves its rank's process changed (the world-server guard's negative control):
seed, default dtype, grad mode, oneDNN and fp32 matmul precision as spec["leave"] says."""

from __future__ import annotations

import torch


def run(spec: dict, out_dir, rank: int) -> dict:
    leave = spec["leave"]
    if "seed" in leave:
        torch.manual_seed(leave["seed"])
    if "default_dtype" in leave:
        torch.set_default_dtype(getattr(torch, leave["default_dtype"]))
    if "grad" in leave:
        torch.set_grad_enabled(leave["grad"])
    if "mkldnn" in leave:
        torch.backends.mkldnn.enabled = leave["mkldnn"]
    if "matmul_precision" in leave:
        torch.set_float32_matmul_precision(leave["matmul_precision"])
    return {"left": leave}
