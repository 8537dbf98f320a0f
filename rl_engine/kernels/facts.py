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
    native: the GEMM's row tile and K slice per dtype, and the outcome of its
    platform probe per dtype on this device type ("invariant", or "refused: <the
    assumptions that failed>"); asking for them runs the probe if it has not run.
    triton: the version of its numerics, the Triton version (its compiler decides the
    machine code), the FP-fusion setting pinned at every launch, and whether the
    kernels are compiled or run by Triton's CPU interpreter (whose bits are its own).
    None of them needs a GPU: the job adds the device's compute capability.
    """
    served = list_backends(device)
    name = backend if backend is not None else served[0]
    if name not in served:  # the facts of a backend that cannot run here would name nothing
        raise ValueError(
            f"kernel_facts: backend {name!r} does not serve device {str(device)!r}; "
            f"backends for it: {', '.join(served)}"
        )
    facts = {"backend": name}
    if name == "cpp":
        from rl_engine.kernels.cpp._extension import NUMERICS_VERSION, bf16_dot_flavour, current_isa

        facts["cpp_numerics"] = NUMERICS_VERSION
        facts["cpp_bf16_dot"] = bf16_dot_flavour(current_isa())
    elif name == "native":
        facts.update(_native_facts(torch.device(device).type))
    elif name == "triton":
        facts.update(_triton_facts())
    return facts


def _triton_facts() -> dict[str, str]:
    import triton

    from rl_engine.kernels.triton._common import INTERPRET
    from rl_engine.kernels.triton._launch import FP_FUSION, NUMERICS_VERSION

    return {
        "triton_numerics": NUMERICS_VERSION,
        "triton_version": triton.__version__,
        "triton_fp_fusion": "on" if FP_FUSION else "off",
        "triton_mode": "interpreter" if INTERPRET else "compiled",
    }


# The model dtypes a run config accepts (fp32, bf16): the ones a job compares facts for.
_RUN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _native_facts(device_type: str) -> dict[str, str]:
    from rl_engine.kernels.native._gemm import TILE_ROWS, k_slice_for
    from rl_engine.kernels.native.platform_probe import probe

    facts = {"native_tile_rows": str(TILE_ROWS)}
    for short, dtype in _RUN_DTYPES.items():
        facts[f"native_{short}_k_slice"] = str(k_slice_for(dtype))
        facts[f"native_{short}_platform"] = probe(dtype, device_type).outcome
    return facts
