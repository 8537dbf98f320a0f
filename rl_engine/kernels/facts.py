"""Facts about the kernels a process runs that decide their bits (the parity contract).

A rollout engine and a trainer hold bitwise parity only if both run the same
numerics. `kernel_facts(device)` names them; the job records it on both sides
and checks the two are equal before the first step.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.registry import list_backends


def kernel_facts(device: str | torch.device, backend: str | None = None) -> dict[str, str]:
    """{fact: value} for the backend that serves `device` (its default when `backend` is None).

    cpp: the version of its numerics and how bf16 dot products are done (the
    VDPBF16PS instruction flushes subnormals, its FMA emulation does not);
    native on CPU: the reduction slice width of bf16 GEMMs (narrower on AMX).
    """
    name = backend if backend is not None else list_backends(device)[0]
    facts = {"backend": name}
    if name == "cpp":
        from rl_engine.kernels.cpp._extension import NUMERICS_VERSION, bf16_dot_flavour, current_isa

        facts["cpp_numerics"] = NUMERICS_VERSION
        facts["cpp_bf16_dot"] = bf16_dot_flavour(current_isa())
    elif name == "native" and torch.device(device).type == "cpu":
        from rl_engine.kernels.native._gemm import k_slice_for

        facts["native_bf16_k_slice"] = str(k_slice_for(torch.bfloat16))
    return facts
