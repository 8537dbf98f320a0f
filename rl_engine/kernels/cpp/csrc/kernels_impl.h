// Fixed-order kernels, written once against the logical 16-lane Vec16 of the
// including ISA file (vec_avx512.h or vec_avx2.h). Included inside one
// namespace per ISA; no torch or std headers here (each ISA file is compiled
// for its own target, and shared inline code must not leak between them).
//
// Numerics, the same on every ISA and for every shape, thread count and
// blocking:
// - dot products (fp32): lane i of a 16-lane fp32 accumulator sums, with one
//   FMA per term, the products of the elements k = i (mod 16) in increasing
//   k; the K tail is read with zeros. The 16 lanes are then added by the fixed
//   tree of hsum (i + i+8, then +4, +2, +1). Nothing depends on M, N, the
//   tile a row lands in or the thread that runs it.
// - dot products (bf16, 32 per step): lane i sums the pairs (2i, 2i+1) of each
//   32-element step, odd element first: the order of VDPBF16PS (exact bf16
//   products, one rounding per add). RL_BF16_DOT_HW uses that instruction (it
//   flushes subnormals); otherwise two FMAs per pair emulate it (no flush).
// - exp: one range reduction + degree-6 polynomial, same ops on every ISA.
#include <cstdint>

// ----------------------------------------------------------------------------- exp

static inline Vec16 vexp(Vec16 x) {
  const Vec16 hi = Vec16::set1(88.3762626647949f);
  const Vec16 lo = Vec16::set1(-87.3365447504019f);  // below: result 0 (also -inf)
  Vec16 xc = vmin(vmax(x, lo), hi);
  Vec16 n = round_nearest(xc * Vec16::set1(1.44269504088896341f));
  Vec16 r = fmadd(n, Vec16::set1(-0.693359375f), xc);  // ln2 split in two: exact n*ln2_hi
  r = fmadd(n, Vec16::set1(2.12194440e-4f), r);
  Vec16 p = Vec16::set1(1.9875691500e-4f);
  p = fmadd(p, r, Vec16::set1(1.3981999507e-3f));
  p = fmadd(p, r, Vec16::set1(8.3334519073e-3f));
  p = fmadd(p, r, Vec16::set1(4.1665795894e-2f));
  p = fmadd(p, r, Vec16::set1(1.6666665459e-1f));
  p = fmadd(p, r, Vec16::set1(5.0000001201e-1f));
  p = fmadd(p, r * r, r + Vec16::set1(1.0f));
  return zero_where_less(x, lo, p * pow2i(n));
}

static inline Vec16 vsilu(Vec16 x) {
  return x / (Vec16::set1(1.0f) + vexp(Vec16::zero() - x));
}

void silu_f32(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vsilu(Vec16::load(x + i)).store(y + i);
  if (i < n) vsilu(Vec16::load_n(x + i, (int)(n - i))).store_n(y + i, (int)(n - i));
}

void silu_bf16(const uint16_t* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vsilu(Vec16::load_bf16(x + i)).store_bf16(y + i);
  if (i < n) {
    uint16_t in[16] = {0}, out[16];
    for (int64_t j = i; j < n; ++j) in[j - i] = x[j];
    vsilu(Vec16::load_bf16(in)).store_bf16(out);
    for (int64_t j = i; j < n; ++j) y[j] = out[j - i];
  }
}

// ----------------------------------------------------------------------------- fp32 GEMM

// y[i, j] = hsum(acc[i][j]); a 4 x 4 tile through the batched hsum16 where the ISA has one.
#ifdef RL_HAVE_HSUM16
#define RL_STORE_SUMS(acc, y, ldy)                                       \
  if constexpr (MR == 4 && NR == 4) {                                    \
    float t_[16];                                                        \
    hsum16(&acc[0][0], t_);                                              \
    for (int i = 0; i < 4; ++i)                                          \
      for (int j = 0; j < 4; ++j) y[i * ldy + j] = t_[i * 4 + j];        \
  } else {                                                               \
    for (int i = 0; i < MR; ++i)                                         \
      for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum(acc[i][j]);     \
  }
#else
#define RL_STORE_SUMS(acc, y, ldy)   \
  for (int i = 0; i < MR; ++i)       \
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum(acc[i][j]);
#endif

// y[i, j] = dot(x row i, w row j) for an MR x NR tile; rows are K long.
template <int MR, int NR>
static void tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                     int64_t ldy, int64_t K) {
  Vec16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec16::zero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    Vec16 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Vec16::load(w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      Vec16 xv = Vec16::load(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = fmadd(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const int rest = (int)(K - k);
    Vec16 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Vec16::load_n(w + j * ldw + k, rest);
    for (int i = 0; i < MR; ++i) {
      Vec16 xv = Vec16::load_n(x + i * ldx + k, rest);
      for (int j = 0; j < NR; ++j) acc[i][j] = fmadd(xv, wv[j], acc[i][j]);
    }
  }
  RL_STORE_SUMS(acc, y, ldy)
}

// ----------------------------------------------------------------------------- bf16 GEMM

#ifdef RL_BF16_DOT_HW
struct RawBf16 {  // 32 bf16 as one register, for VDPBF16PS
  __m512i v;
  static inline RawBf16 load(const uint16_t* p) { return {_mm512_loadu_si512((const void*)p)}; }
};
static inline Vec16 dot_pairs(RawBf16 a, RawBf16 b, Vec16 acc) {
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)a.v, (__m512bh)b.v)};
}
typedef RawBf16 Bf16Step;
#else
static inline Vec16 dot_pairs(const PairsBf16& a, const PairsBf16& b, Vec16 acc) {
  acc = fmadd(a.odd, b.odd, acc);  // VDPBF16PS order: element 2i+1, then 2i
  return fmadd(a.even, b.even, acc);
}
typedef PairsBf16 Bf16Step;
#endif

template <int MR, int NR>
static inline void bf16_step(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                             Vec16 (&acc)[MR][NR]) {
  Bf16Step wv[NR];
  for (int j = 0; j < NR; ++j) wv[j] = Bf16Step::load(w + j * ldw);
  for (int i = 0; i < MR; ++i) {
    Bf16Step xv = Bf16Step::load(x + i * ldx);
    for (int j = 0; j < NR; ++j) acc[i][j] = dot_pairs(xv, wv[j], acc[i][j]);
  }
}

template <int MR, int NR>
static void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
                      int64_t ldy, int64_t K) {
  Vec16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec16::zero();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) bf16_step<MR, NR>(x + k, ldx, w + k, ldw, acc);
  if (k < K) {  // tail: zero-padded copies, then the very same step
    uint16_t xt[MR][32] = {{0}}, wt[NR][32] = {{0}};
    for (int i = 0; i < MR; ++i)
      for (int64_t t = k; t < K; ++t) xt[i][t - k] = x[i * ldx + t];
    for (int j = 0; j < NR; ++j)
      for (int64_t t = k; t < K; ++t) wt[j][t - k] = w[j * ldw + t];
    bf16_step<MR, NR>(&xt[0][0], 32, &wt[0][0], 32, acc);
  }
  RL_STORE_SUMS(acc, y, ldy)
}

// ----------------------------------------------------------------------------- GEMM drivers

template <int MR, int NR>
struct F32Tile {
  static void run(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                  int64_t K) {
    tile_f32<MR, NR>(x, ldx, w, ldw, y, ldy, K);
  }
};
template <int MR, int NR>
struct Bf16Tile {
  static void run(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
                  int64_t ldy, int64_t K) {
    tile_bf16<MR, NR>(x, ldx, w, ldw, y, ldy, K);
  }
};

// Dispatch an (mr <= MR) x (nr <= NR) tile to its instantiation.
template <typename T, template <int, int> class Tile, int MR, int NR>
static inline void run_tile(int mr, int nr, const T* x, int64_t ldx, const T* w, int64_t ldw,
                            float* y, int64_t ldy, int64_t K) {
  if constexpr (MR > 1) {
    if (mr < MR) return run_tile<T, Tile, MR - 1, NR>(mr, nr, x, ldx, w, ldw, y, ldy, K);
  }
  if constexpr (NR > 1) {
    if (nr < NR) return run_tile<T, Tile, MR, NR - 1>(mr, nr, x, ldx, w, ldw, y, ldy, K);
  }
  Tile<MR, NR>::run(x, ldx, w, ldw, y, ldy, K);
}

// y (M x N, row stride ldy) = x (M x K) @ w (N x K)^T. Row-major, K contiguous.
template <typename T, template <int, int> class Tile>
static void gemm_block(const T* x, int64_t ldx, const T* w, int64_t ldw, float* y, int64_t ldy,
                       int64_t M, int64_t N, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
    const int mr = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
    for (int64_t n0 = 0; n0 < N; n0 += NR_MAX) {
      const int nr = (int)(N - n0 < NR_MAX ? N - n0 : NR_MAX);
      run_tile<T, Tile, MR_MAX, NR_MAX>(mr, nr, x + m0 * ldx, ldx, w + n0 * ldw, ldw,
                                        y + m0 * ldy + n0, ldy, K);
    }
  }
}

void gemm_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
              int64_t M, int64_t N, int64_t K) {
  gemm_block<float, F32Tile>(x, ldx, w, ldw, y, ldy, M, N, K);
}

void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
               int64_t ldy, int64_t M, int64_t N, int64_t K) {
  gemm_block<uint16_t, Bf16Tile>(x, ldx, w, ldw, y, ldy, M, N, K);
}
