// Logical 16-lane fp32 vector on AVX2: two ymm registers, lanes 0-7 (lo) and
// 8-15 (hi). Each op is the lane-wise twin of vec_avx512.h, so the bits match.
#pragma once
#include <immintrin.h>
#include <cstdint>

static inline __m256i rl_mask8(int n) {  // first n of 8 lanes set (n may be <0 or >8)
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}

struct Vec16 {
  __m256 lo, hi;
  static inline Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static inline Vec16 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  static inline Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static inline Vec16 load_n(const float* p, int n) {
    return {_mm256_maskload_ps(p, rl_mask8(n)), _mm256_maskload_ps(p + 8, rl_mask8(n - 8))};
  }
  static inline __m256 widen8(const uint16_t* p) {
    __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline Vec16 load_bf16(const uint16_t* p) { return {widen8(p), widen8(p + 8)}; }
  inline void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  inline void store_n(float* p, int n) const {
    _mm256_maskstore_ps(p, rl_mask8(n), lo);
    _mm256_maskstore_ps(p + 8, rl_mask8(n - 8), hi);
  }
  static inline __m128i to_bf16_8(__m256 x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
    r = _mm256_srli_epi32(r, 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    return packed;
  }
  inline void store_bf16(uint16_t* p) const {
    _mm_storeu_si128((__m128i*)p, to_bf16_8(lo));
    _mm_storeu_si128((__m128i*)(p + 8), to_bf16_8(hi));
  }
};

static inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline Vec16 vmin(Vec16 a, Vec16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
static inline Vec16 round_nearest(Vec16 a) {
  const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
static inline __m256 rl_pow2i8(__m256 n) {
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline Vec16 pow2i(Vec16 n) { return {rl_pow2i8(n.lo), rl_pow2i8(n.hi)}; }
static inline Vec16 zero_where_less(Vec16 a, Vec16 b, Vec16 x) {
  return {_mm256_and_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_NLT_UQ), x.lo),
          _mm256_and_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_NLT_UQ), x.hi)};
}
static inline float hsum(Vec16 a) {
  __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
static inline float hmax(Vec16 a) {
  __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}

struct PairsBf16 {
  Vec16 even, odd;
  static inline PairsBf16 load(const uint16_t* p) {
    __m256i a = _mm256_loadu_si256((const __m256i*)p);
    __m256i b = _mm256_loadu_si256((const __m256i*)(p + 16));
    __m256i m = _mm256_set1_epi32((int)0xffff0000u);
    return {{_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))},
            {_mm256_castsi256_ps(_mm256_and_si256(a, m)), _mm256_castsi256_ps(_mm256_and_si256(b, m))}};
  }
};
