// The fixed-order kernels compiled for avx512. No torch headers in this file:
// inline code compiled for one target must not be shared with the others.
#include <immintrin.h>
#include <cstdint>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")


namespace rl_avx512 {
#define RL_GEMM_AVX512  // 16 x 16 register transposes when packing GEMM panels
constexpr int MR_MAX = 6, NV_MAX = 4;  // GEMM register tile (rows x 16-column vectors); speed only
constexpr int ATT_ROWS = 8;      // attention score rows per register tile
constexpr int PV_ACC_BUDGET = 24; // attention p @ v accumulators (16-lane vectors)
#include "vec_avx512.h"
#include "kernels_impl.h"
#include "attention_impl.h"
}  // namespace rl_avx512
