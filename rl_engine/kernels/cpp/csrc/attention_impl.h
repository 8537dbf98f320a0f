// Fixed-order causal GQA attention, written once against the logical 16-lane
// Vec16 of the including ISA file. Included inside one namespace per ISA, right
// after kernels_impl.h (it uses vexp, hsum and hmax from there); no torch or
// std headers here.
#include <cstdint>

// ----------------------------------------------------------------------------- attention

// Causal attention for a block of query rows of one kv head: nq queries (their
// G heads each, row r = i * G + g) against the keys and values at positions
// 0..p_i of that kv head. For every row, in an order set by p and D alone:
//   s_j  = sum_d (q_d * scale) k_jd      16 keys per vector, one FMA per d in increasing d
//   m    = max_j s_j                     exact
//   e_j  = exp(s_j - m);  l = sum_j e_j  lane j mod 16, then the fixed hsum tree
//   o    = (sum_j e_j v_j) / l           lanes over d, one FMA per key in increasing j
// Which other rows share the block, tile or thread changes nothing, so a decode
// step (a query alone) gives the bits of its prefill row. Keys past p are never
// read into a row's result (their lanes are set to -inf before the max; p @ v
// stops at p), so garbage there, even inf or nan, cannot leak.

constexpr int kMaxHeadChunks = 16;  // D <= 256
constexpr int kMaxBlockRows = 256;  // nq * G

// ----------------------------------------------------------------------------- key packing

// Whether Vec16 is one zmm register (vec_avx512.h) rather than two ymm (vec_avx2.h).
template <typename V, typename = void>
struct IsZmm {
  static constexpr bool value = false;
};
template <typename V>
struct IsZmm<V, decltype((void)V{}.v)> {
  static constexpr bool value = true;
};

// r[i] lane j -> r[j] lane i, for one zmm per row (data movement only).
template <typename V>
static inline void transpose16(V (&r)[16]) {
  if constexpr (IsZmm<V>::value) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i].v, r[2 * i + 1].v);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i].v, r[2 * i + 1].v);
    }
    __m512 u[16];  // u[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c
    for (int i = 0; i < 4; ++i) {
      u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      t[c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
      t[4 + c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
      t[8 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
      t[12 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    }
    for (int c = 0; c < 4; ++c) {
      r[c].v = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
      r[8 + c].v = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
      r[4 + c].v = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
      r[12 + c].v = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xDD);
    }
  } else {
    float buf[16][16];
    for (int i = 0; i < 16; ++i) r[i].store(buf[i]);
    float tr[16][16];
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) tr[j][i] = buf[i][j];
    for (int i = 0; i < 16; ++i) r[i] = V::load(tr[i]);
  }
}

// 16 values from p as fp32: n (< 16) of them, the rest 0. bf16 widens exactly.
static inline Vec16 load_part(const float* p, int n) { return Vec16::load_n(p, n); }
static inline Vec16 load_part(const uint16_t* p, int n) {
  uint16_t t[16] = {0};
  for (int i = 0; i < n; ++i) t[i] = p[i];
  return Vec16::load_bf16(t);
}
static inline Vec16 load_full(const float* p) { return Vec16::load(p); }
static inline Vec16 load_full(const uint16_t* p) { return Vec16::load_bf16(p); }

// Keys 0..n-1 (rows of D, row stride D; fp32 or bf16) into fp32 16-key blocks
// kt[b][d][16] (lane jj of block b, row d = k[(16b + jj) * D + d]); lanes past
// n are 0. Data movement only (bf16 -> fp32 is exact).
template <typename T>
static void pack_keys(const T* k, int64_t n, int64_t D, float* kt) {
  const int nd = (int)((D + 15) / 16);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int valid = (int)(n - j0 < 16 ? n - j0 : 16);
    float* blk = kt + (j0 / 16) * D * 16;
    for (int c = 0; c < nd; ++c) {
      const int dc = (int)(D - c * 16 < 16 ? D - c * 16 : 16);
      Vec16 r[16];
      const T* src = k + j0 * D + c * 16;
      if (valid == 16 && dc == 16) {  // the common case, with no branches for the registers
        for (int jj = 0; jj < 16; ++jj) r[jj] = load_full(src + jj * D);
        transpose16(r);
        for (int d = 0; d < 16; ++d) r[d].store(blk + (c * 16 + d) * 16);
        continue;
      }
      for (int jj = 0; jj < 16; ++jj)
        r[jj] = jj >= valid ? Vec16::zero() : load_part(src + jj * D, dc);
      transpose16(r);
      for (int d = 0; d < dc; ++d) r[d].store(blk + (c * 16 + d) * 16);
    }
  }
}

void attention_pack_keys(const float* k, int64_t n, int64_t D, float* kt) {
  pack_keys(k, n, D, kt);
}
void attention_pack_keys_bf16(const uint16_t* k, int64_t n, int64_t D, float* kt) {
  pack_keys(k, n, D, kt);
}

// n bf16 values widened to fp32 (exact): values read by p @ v.
void attention_widen_bf16(const uint16_t* x, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) Vec16::load_bf16(x + i).store(y + i);
  if (i < n) load_part(x + i, (int)(n - i)).store_n(y + i, (int)(n - i));
}

// ----------------------------------------------------------------------------- scores

// Scores of `count` rows (indices rows[]) against NB consecutive 16-key blocks
// kt (each D x 16, packed): S[row, j0 + 16 b + lane]. Register tile: RT rows x NB blocks.
template <int RT, int NB>
static inline void score_tile(const float* qsc, int64_t D, const int* rows, const float* kt,
                              float* S, int64_t L, int64_t j0) {
  Vec16 acc[RT][NB];
  #pragma GCC unroll 32
  for (int r = 0; r < RT; ++r)
    #pragma GCC unroll 32
    for (int b = 0; b < NB; ++b) acc[r][b] = Vec16::zero();
  const float* qr[RT];
  #pragma GCC unroll 32
  for (int r = 0; r < RT; ++r) qr[r] = qsc + rows[r] * D;
  for (int64_t d = 0; d < D; ++d) {
    Vec16 kv[NB];
    #pragma GCC unroll 32
    for (int b = 0; b < NB; ++b) kv[b] = Vec16::load(kt + b * D * 16 + d * 16);
    #pragma GCC unroll 32
    for (int r = 0; r < RT; ++r) {
      const Vec16 qd = Vec16::set1(qr[r][d]);
      #pragma GCC unroll 32
      for (int b = 0; b < NB; ++b) acc[r][b] = fmadd(qd, kv[b], acc[r][b]);
    }
  }
  #pragma GCC unroll 32
  for (int r = 0; r < RT; ++r)
    #pragma GCC unroll 32
    for (int b = 0; b < NB; ++b) acc[r][b].store(S + rows[r] * L + j0 + b * 16);
}

// A tail of rest < RT rows as one tile.
template <int RT, int NB>
static inline void score_rest(int rest, const float* qsc, int64_t D, const int* rows,
                              const float* kt, float* S, int64_t L, int64_t j0) {
  if constexpr (RT > 1) {
    if (rest < RT) return score_rest<RT - 1, NB>(rest, qsc, D, rows, kt, S, L, j0);
  }
  score_tile<RT, NB>(qsc, D, rows, kt, S, L, j0);
}

template <int NB>
static void score_rows(const float* qsc, int64_t D, const int* rows, int count, const float* kt,
                       float* S, int64_t L, int64_t j0) {
  constexpr int RT = IsZmm<Vec16>::value || NB == 1 ? ATT_ROWS : ATT_ROWS / NB;
  int t = 0;
  for (; t + RT <= count; t += RT) score_tile<RT, NB>(qsc, D, rows + t, kt, S, L, j0);
  if (t < count) score_rest<RT, NB>(count - t, qsc, D, rows + t, kt, S, L, j0);
}

// Mask past p, exp in place, return l. S holds round_up(p + 1, 16) scores.
static float softmax_row(float* S, int64_t p) {
  const int64_t Lr = (p + 1 + 15) / 16 * 16;
  for (int64_t j = p + 1; j < Lr; ++j) S[j] = -__builtin_inff();
  Vec16 mv = Vec16::load(S);
  for (int64_t j = 16; j < Lr; j += 16) mv = vmax(mv, Vec16::load(S + j));
  const Vec16 m = Vec16::set1(hmax(mv));
  Vec16 lsum = Vec16::zero();
  for (int64_t j = 0; j < Lr; j += 16) {
    const Vec16 e = vexp(Vec16::load(S + j) - m);
    e.store(S + j);
    lsum = lsum + e;
  }
  return hsum(lsum);
}

// o_r = (sum_{j <= p_r} e_rj v_j) / l_r for RT rows; the shared keys first, then each row's rest.
template <int RT, int ND>
static void weighted_values(const float* const* e, const int64_t* p, const float* l,
                            float* const* out, const float* v, int64_t ldk, int dtail) {
  Vec16 acc[RT][ND];
  #pragma GCC unroll 32
  for (int r = 0; r < RT; ++r)
    #pragma GCC unroll 32
    for (int c = 0; c < ND; ++c) acc[r][c] = Vec16::zero();
  int64_t pmin = p[0];
  for (int r = 1; r < RT; ++r) pmin = p[r] < pmin ? p[r] : pmin;
  for (int64_t j = 0; j <= pmin; ++j) {
    Vec16 vj[ND];
    #pragma GCC unroll 32
    for (int c = 0; c < ND - 1; ++c) vj[c] = Vec16::load(v + j * ldk + c * 16);
    vj[ND - 1] = Vec16::load_n(v + j * ldk + (ND - 1) * 16, dtail);
    #pragma GCC unroll 32
    for (int r = 0; r < RT; ++r) {
      const Vec16 er = Vec16::set1(e[r][j]);
      #pragma GCC unroll 32
      for (int c = 0; c < ND; ++c) acc[r][c] = fmadd(er, vj[c], acc[r][c]);
    }
  }
  #pragma GCC unroll 32
  for (int r = 0; r < RT; ++r) {
    for (int64_t j = pmin + 1; j <= p[r]; ++j) {
      const Vec16 er = Vec16::set1(e[r][j]);
      #pragma GCC unroll 32
      for (int c = 0; c < ND - 1; ++c)
        acc[r][c] = fmadd(er, Vec16::load(v + j * ldk + c * 16), acc[r][c]);
      acc[r][ND - 1] = fmadd(er, Vec16::load_n(v + j * ldk + (ND - 1) * 16, dtail), acc[r][ND - 1]);
    }
    const Vec16 lr = Vec16::set1(l[r]);
    #pragma GCC unroll 32
    for (int c = 0; c < ND - 1; ++c) (acc[r][c] / lr).store(out[r] + c * 16);
    (acc[r][ND - 1] / lr).store_n(out[r] + (ND - 1) * 16, dtail);
  }
}

// A tail of rest < RT rows as one tile (they share the value loads).
template <int RT, int ND>
static inline void values_rest(int rest, const float* const* e, const int64_t* p, const float* l,
                               float* const* out, const float* v, int64_t ldk, int dtail) {
  if constexpr (RT > 1) {
    if (rest < RT) return values_rest<RT - 1, ND>(rest, e, p, l, out, v, ldk, dtail);
  }
  weighted_values<RT, ND>(e, p, l, out, v, ldk, dtail);
}

template <int ND>
static void weighted_values_rows(const float* const* e, const int64_t* p, const float* l,
                                 float* const* out, int count, const float* v, int64_t ldk,
                                 int dtail) {
  constexpr int RT = PV_ACC_BUDGET / ND > 0 ? PV_ACC_BUDGET / ND : 1;
  int t = 0;
  for (; t + RT <= count; t += RT) weighted_values<RT, ND>(e + t, p + t, l + t, out + t, v, ldk, dtail);
  if (t < count) values_rest<RT, ND>(count - t, e + t, p + t, l + t, out + t, v, ldk, dtail);
}

template <int ND>
static void dispatch_values(int nd, const float* const* e, const int64_t* p, const float* l,
                            float* const* out, int count, const float* v, int64_t ldk, int dtail) {
  if constexpr (ND < kMaxHeadChunks) {
    if (nd > ND) return dispatch_values<ND + 1>(nd, e, p, l, out, count, v, ldk, dtail);
  }
  weighted_values_rows<ND>(e, p, l, out, count, v, ldk, dtail);
}

// q row (query i, head g) at q + g * ldq_head + i * D, out row at out + g * ldo_head + i * D;
// kt: the keys of one kv head packed by attention_pack_keys (at least
// round_up(max pos + 1, 16) positions); v: rows of D (row stride D) of that
// kv head. scratch: R * (D + L) floats (see the binding).
void attention_block(const float* q, int64_t ldq_head, int G, int nq, const int64_t* pos,
                     const float* kt, const float* v, int64_t Tk, int64_t D, float scale,
                     float* out, int64_t ldo_head, float* scratch) {
  (void)Tk;  // the packed keys hold every position a row reads (the binding checked Tk)
  int64_t pmax = -1;
  for (int i = 0; i < nq; ++i) pmax = pos[i] > pmax ? pos[i] : pmax;
  if (pmax < 0) return;
  const int R = nq * G;
  const int64_t L = (pmax + 1 + 15) / 16 * 16;
  float* qsc = scratch;     // R x D: scaled queries
  float* S = qsc + R * D;   // R x L: scores, then exp
  int rows[kMaxBlockRows];
  int64_t p[kMaxBlockRows];
  const float* e[kMaxBlockRows];
  float* o[kMaxBlockRows];
  float l[kMaxBlockRows];
  int live = 0;
  const Vec16 vscale = Vec16::set1(scale);
  const int nd = (int)((D + 15) / 16);
  const int dtail = (int)(D - (int64_t)(nd - 1) * 16);
  for (int i = 0; i < nq; ++i) {
    if (pos[i] < 0) continue;
    for (int g = 0; g < G; ++g) {
      const int r = i * G + g;
      const float* qr = q + g * ldq_head + i * D;
      for (int c = 0; c < nd - 1; ++c) (Vec16::load(qr + c * 16) * vscale).store(qsc + r * D + c * 16);
      (Vec16::load_n(qr + (nd - 1) * 16, dtail) * vscale).store_n(qsc + r * D + (nd - 1) * 16, dtail);
      rows[live] = r;
      p[live] = pos[i];
      e[live] = S + r * L;
      o[live] = out + g * ldo_head + i * D;
      ++live;
    }
  }
  // Key blocks two at a time: rows that reach the second block score both in one tile.
  for (int64_t j0 = 0; j0 < L; j0 += 32) {
    int both[kMaxBlockRows], first[kMaxBlockRows];
    int n2 = 0, n1 = 0;
    for (int t = 0; t < live; ++t) {
      if (p[t] >= j0 + 16) both[n2++] = rows[t];
      else if (p[t] >= j0) first[n1++] = rows[t];
    }
    const float* kb = kt + (j0 / 16) * D * 16;
    if (n2) score_rows<2>(qsc, D, both, n2, kb, S, L, j0);
    if (n1) score_rows<1>(qsc, D, first, n1, kb, S, L, j0);
  }
  for (int t = 0; t < live; ++t) l[t] = softmax_row(S + rows[t] * L, p[t]);
  dispatch_values<1>(nd, e, p, l, o, live, v, D, dtail);
}
