// Logical 16-lane fp32 vector on AVX-512: one zmm register.
// Every op here has an exact twin in vec_avx2.h (two ymm registers, lanes
// 0-7 and 8-15) that rounds identically, so both ISAs give the same bits.
#pragma once
#include <immintrin.h>
#include <cstdint>

struct Vec16 {
  __m512 v;
  static inline Vec16 zero() { return {_mm512_setzero_ps()}; }
  static inline Vec16 set1(float a) { return {_mm512_set1_ps(a)}; }
  static inline Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static inline Vec16 load_n(const float* p, int n) {
    return {_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p)};
  }
  // 16 bf16 values widened to fp32 (exact).
  static inline Vec16 load_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  inline void store(float* p) const { _mm512_storeu_ps(p, v); }
  inline void store_n(float* p, int n) const {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), v);
  }
  // fp32 -> bf16, round to nearest even (NaN stays NaN), same integer steps as torch.
  inline void store_bf16(uint16_t* p) const {
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
};

static inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline Vec16 vmin(Vec16 a, Vec16 b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline Vec16 round_nearest(Vec16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n for integral n in [-126, 127] given as floats.
static inline Vec16 pow2i(Vec16 n) {
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
// lanes where a < b get 0 (exactly +0.0f).
static inline Vec16 zero_where_less(Vec16 a, Vec16 b, Vec16 x) {
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_NLT_UQ), x.v)};
}
// Fixed tree: 16 -> 8 (lanes i + i+8) -> 4 -> 2 -> 1.
static inline float hsum(Vec16 a) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
static inline float hmax(Vec16 a) {
  __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}

// Pairs of bf16 (32 values, lane j holds elements 2j and 2j+1), widened exactly.
struct PairsBf16 {
  Vec16 even, odd;
  static inline PairsBf16 load(const uint16_t* p) {
    __m512i w = _mm512_loadu_si512((const void*)p);
    return {{_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))},
            {_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)))}};
  }
};
