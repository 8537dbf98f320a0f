"""Triton backend (CUDA/ROCm). Not implemented yet: provides no ops.

`get_op(name, "cuda")` therefore resolves to the native backend, and an
explicit `backend="triton"` request raises, listing what this module provides.
See docs/adding-a-backend.md.
"""

import triton  # noqa: F401  (a missing triton must fail the explicit request loudly)
