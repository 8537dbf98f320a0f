"""Build DeepSpeed's CPU communication op now (`make setup`), not inside the first training step.

DeepSpeed JIT-compiles `deepspeed_shm_comm` the first time a rank joins a process group
on CPU (about a minute). The build is cached in TORCH_EXTENSIONS_DIR, which `rl-engine`
points inside the virtualenv, so two checkouts do not rebuild each other's cache.
"""

from __future__ import annotations

import os
import sys
import time

from rl_engine.cli import use_venv_op_cache


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    use_venv_op_cache()
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        print("DeepSpeed's CPU communication op does not apply here: nothing to build")
        return 0
    print(
        "building DeepSpeed's CPU op (deepspeed_shm_comm; about a minute the first time, then "
        f"cached in {os.environ['TORCH_EXTENSIONS_DIR']}) ...",
        flush=True,
    )
    started = time.perf_counter()
    builder.load(verbose=False)
    print(f"DeepSpeed CPU op ready ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
