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

// Scores of `count` rows (indices rows[]) against one transposed 16-key block kt (D x 16).
static void score_rows(const float* qsc, int64_t D, const int* rows, int count, const float* kt,
                       float* S, int64_t L, int64_t j0) {
  int t = 0;
  for (; t + ATT_ROWS <= count; t += ATT_ROWS) {
    Vec16 acc[ATT_ROWS];
    for (int r = 0; r < ATT_ROWS; ++r) acc[r] = Vec16::zero();
    for (int64_t d = 0; d < D; ++d) {
      const Vec16 kv = Vec16::load(kt + d * 16);
      for (int r = 0; r < ATT_ROWS; ++r)
        acc[r] = fmadd(Vec16::set1(qsc[rows[t + r] * D + d]), kv, acc[r]);
    }
    for (int r = 0; r < ATT_ROWS; ++r) acc[r].store(S + rows[t + r] * L + j0);
  }
  for (; t < count; ++t) {
    Vec16 acc = Vec16::zero();
    for (int64_t d = 0; d < D; ++d)
      acc = fmadd(Vec16::set1(qsc[rows[t] * D + d]), Vec16::load(kt + d * 16), acc);
    acc.store(S + rows[t] * L + j0);
  }
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
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < ND; ++c) acc[r][c] = Vec16::zero();
  int64_t pmin = p[0];
  for (int r = 1; r < RT; ++r) pmin = p[r] < pmin ? p[r] : pmin;
  for (int64_t j = 0; j <= pmin; ++j) {
    Vec16 vj[ND];
    for (int c = 0; c < ND - 1; ++c) vj[c] = Vec16::load(v + j * ldk + c * 16);
    vj[ND - 1] = Vec16::load_n(v + j * ldk + (ND - 1) * 16, dtail);
    for (int r = 0; r < RT; ++r) {
      const Vec16 er = Vec16::set1(e[r][j]);
      for (int c = 0; c < ND; ++c) acc[r][c] = fmadd(er, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    for (int64_t j = pmin + 1; j <= p[r]; ++j) {
      const Vec16 er = Vec16::set1(e[r][j]);
      for (int c = 0; c < ND - 1; ++c)
        acc[r][c] = fmadd(er, Vec16::load(v + j * ldk + c * 16), acc[r][c]);
      acc[r][ND - 1] = fmadd(er, Vec16::load_n(v + j * ldk + (ND - 1) * 16, dtail), acc[r][ND - 1]);
    }
    const Vec16 lr = Vec16::set1(l[r]);
    for (int c = 0; c < ND - 1; ++c) (acc[r][c] / lr).store(out[r] + c * 16);
    (acc[r][ND - 1] / lr).store_n(out[r] + (ND - 1) * 16, dtail);
  }
}

template <int ND>
static void weighted_values_rows(const float* const* e, const int64_t* p, const float* l,
                                 float* const* out, int count, const float* v, int64_t ldk,
                                 int dtail) {
  constexpr int RT = PV_ACC_BUDGET / ND > 0 ? PV_ACC_BUDGET / ND : 1;
  int t = 0;
  for (; t + RT <= count; t += RT) weighted_values<RT, ND>(e + t, p + t, l + t, out + t, v, ldk, dtail);
  for (; t < count; ++t) weighted_values<1, ND>(e + t, p + t, l + t, out + t, v, ldk, dtail);
}

template <int ND>
static void dispatch_values(int nd, const float* const* e, const int64_t* p, const float* l,
                            float* const* out, int count, const float* v, int64_t ldk, int dtail) {
  if constexpr (ND < kMaxHeadChunks) {
    if (nd > ND) return dispatch_values<ND + 1>(nd, e, p, l, out, count, v, ldk, dtail);
  }
  weighted_values_rows<ND>(e, p, l, out, count, v, ldk, dtail);
}

// q row (query i, head g) at q + g * ldq_head + i * D, same addressing for out;
// k, v: Tk rows of D (row stride D) of one kv head. scratch: see the binding.
void attention_block(const float* q, int64_t ldq_head, int G, int nq, const int64_t* pos,
                     const float* k, const float* v, int64_t Tk, int64_t D, float scale,
                     float* out, float* scratch) {
  int64_t pmax = -1;
  for (int i = 0; i < nq; ++i) pmax = pos[i] > pmax ? pos[i] : pmax;
  if (pmax < 0) return;
  const int R = nq * G;
  const int64_t L = (pmax + 1 + 15) / 16 * 16;
  float* kt = scratch;      // D x 16: one key block, transposed
  float* qsc = kt + D * 16; // R x D: scaled queries
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
      o[live] = out + g * ldq_head + i * D;
      ++live;
    }
  }
  const int64_t readable = (pmax + 1 < Tk ? pmax + 1 : Tk);
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int64_t valid = readable - j0 < 16 ? readable - j0 : 16;
    for (int64_t d = 0; d < D; ++d)
      for (int64_t jj = 0; jj < 16; ++jj) kt[d * 16 + jj] = jj < valid ? k[(j0 + jj) * D + d] : 0.0f;
    int need[kMaxBlockRows];
    int count = 0;
    for (int t = 0; t < live; ++t)
      if (p[t] >= j0) need[count++] = rows[t];
    score_rows(qsc, D, need, count, kt, S, L, j0);
  }
  for (int t = 0; t < live; ++t) l[t] = softmax_row(S + rows[t] * L, p[t]);
  dispatch_values<1>(nd, e, p, l, o, live, v, D, dtail);
}
