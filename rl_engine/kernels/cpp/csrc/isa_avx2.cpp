// The fixed-order kernels compiled for avx2. No torch headers in this file:
// inline code compiled for one target must not be shared with the others.
#include <immintrin.h>
#include <cstdint>

#pragma GCC target("avx2,fma")


namespace rl_avx2 {
constexpr int MR_MAX = 2, NV_MAX = 2;  // GEMM register tile (rows x 16-column vectors); speed only
constexpr int ATT_ROWS = 4;      // attention score rows per register tile
constexpr int PV_ACC_BUDGET = 6; // attention p @ v accumulators (16-lane vectors)
#include "vec_avx2.h"
#include "kernels_impl.h"
#include "attention_impl.h"
}  // namespace rl_avx2
