"""Moved to `rl_engine.kernels.common.checks` (shared by every backend); kept as an alias."""

from rl_engine.kernels.common.checks import (  # noqa: F401
    FLOAT_DTYPES,
    at_least_fp32,
    check_embedding,
    check_floating,
    check_index_range,
    check_last_dim,
    check_projection,
    check_same_dtype,
)
