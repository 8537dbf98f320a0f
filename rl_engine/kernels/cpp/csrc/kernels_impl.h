// Fixed-order kernels, written once against the logical 16-lane Vec16 of the
// including ISA file (vec_avx512.h or vec_avx2.h). Included inside one
// namespace per ISA; no torch or std headers here (each ISA file is compiled
// for its own target, and shared inline code must not leak between them).
//
// Numerics, the same on every ISA and for every shape, thread count and
// blocking:
// - GEMM (fp32 and bf16): the serial K chain of gemm_impl.h: one accumulator
//   per output, fma in increasing k (bf16: VDPBF16PS pairs in increasing pair
//   order); nothing depends on M, N, the tile a row lands in or the thread.
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

// ----------------------------------------------------------------------------- GEMM

#include "gemm_impl.h"  // the fixed-order GEMM (serial K chain); numerics there
