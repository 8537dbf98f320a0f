// Fixed-order GEMM, y (M x N, fp32) = x (M x K) @ w (N x K)^T, written once
// against the logical 16-lane Vec16 of the including ISA file; included by
// kernels_impl.h inside one namespace per ISA (no torch or std headers).
//
// Numerics ("serial K chain"), the same for every shape, tile, blocking,
// thread count and, for fp32, every ISA:
// - fp32: y[m, n] = acc, acc = +0.0f, then for k = 0 .. K-1 in increasing
//   order acc = fma(x[m, k], w[n, k], acc). One accumulator per output, no
//   horizontal sums. Blocking K only stores acc to y and reloads it (exact).
// - bf16 (fp32 accumulation): for pairs p = 0 .. ceil(K/2)-1 in increasing
//   order acc += x[m, 2p+1] * w[n, 2p+1], then acc += x[m, 2p] * w[n, 2p],
//   each product exact and each add rounded: the order of VDPBF16PS. An odd K
//   is padded with one zero pair element (x and w both +0). RL_BF16_DOT_HW
//   uses the instruction (it flushes subnormals); otherwise two FMAs per pair
//   emulate it (no flush).
// Nothing depends on M, the row's position, the tile, the K/M/N blocking or
// the thread: a decode row (M = 1) has the bits of the same row in training.
//
// Output (GemmOut, applied to each row tile right after its last K block,
// while it is in L1; the same bits as the unfused torch steps
// `y.to(out_dtype) + bias.to(out_dtype)`):
// - fp32 out: acc, then acc + bias[n] (one fp32 add) with a bias.
// - bf16 out: r = bf16(acc) (round to nearest even, NaN stays NaN: torch's
//   integer steps), then with a bias bf16(float(r) + float(bias[n])).
// The fp32 accumulator tile lives in `acc` (y itself for fp32 out) between K
// blocks; a bf16 output only ever receives the finished values.
//
// Layout (speed only, never the bits): w is packed per K block into panels of
// kPanel = 64 columns, K-major (fp32: panel[k][64]; bf16: VNNI pairs,
// panel[k/2][64][2]), by 16 x 16 (AVX-512) or 8 x 8 (AVX2) register
// transposes of w's rows. The micro-kernel keeps MR_MAX rows x 64 columns of
// accumulators in registers, broadcasts x[m, k] (bf16: the pair
// x[m, 2p..2p+1]) and walks k upward. Decode-sized M (AVX-512 fp32: M <= 2;
// AVX2 fp32 and bf16: M <= 4) skips the panel: each register-transposed block
// of w is used at once (gemv_*), with the same chain per output.

constexpr int kPanel = 64;        // columns per packed panel (4 vectors)
constexpr int64_t kBlockN = 256;  // columns packed at once (4 panels)

static inline float rl_bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t rl_load_u32(const uint16_t* p) {
  uint32_t u;
  __builtin_memcpy(&u, p, 4);
  return u;
}

// ----------------------------------------------------------------------------- packing

#ifdef RL_GEMM_AVX512
// In-register transpose of 16 rows of 16 x 32-bit values.
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}
#endif

#ifndef RL_GEMM_AVX512
// In-register transpose of 8 rows of 8 x 32-bit values (AVX2).
static inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    r[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    r[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    r[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    r[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x20);
    t[4 + i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

// 8 rows (j0 .. j0+7 of w, rows >= nr read as 0) of 8 x 32-bit values at element offset k.
static inline void load_rows8(const float* w, int64_t ldw, int j0, int nr, int64_t k, __m256 r[8]) {
  for (int i = 0; i < 8; ++i)
    r[i] = j0 + i < nr ? _mm256_loadu_ps(w + (j0 + i) * ldw + k) : _mm256_setzero_ps();
}
#endif

// out[k * 64 + j] = w[j * ldw + k] for k < kc, j < nr; columns nr .. 63 are 0.
static void pack_f32(const float* w, int64_t ldw, int nr, int64_t kc, float* out) {
#ifdef RL_GEMM_AVX512
  for (int j0 = 0; j0 < kPanel; j0 += 16) {
    for (int64_t k0 = 0; k0 < kc; k0 += 16) {
      const int kn = (int)(kc - k0 < 16 ? kc - k0 : 16);
      const __mmask16 km = (__mmask16)((1u << kn) - 1u);
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < nr ? _mm512_maskz_loadu_ps(km, w + (j0 + i) * ldw + k0)
                           : _mm512_setzero_ps();
      transpose16(r);
      for (int t = 0; t < kn; ++t) _mm512_storeu_ps(out + (k0 + t) * kPanel + j0, r[t]);
    }
  }
#else
  for (int j0 = 0; j0 < kPanel; j0 += 8) {
    int64_t k0 = 0;
    for (; k0 + 8 <= kc; k0 += 8) {  // 8 x 8 blocks through registers
      __m256 r[8];
      load_rows8(w, ldw, j0, nr, k0, r);
      transpose8(r);
      for (int t = 0; t < 8; ++t) _mm256_storeu_ps(out + (k0 + t) * kPanel + j0, r[t]);
    }
    for (; k0 < kc; ++k0)
      for (int j = j0; j < j0 + 8; ++j) out[k0 * kPanel + j] = j < nr ? w[j * ldw + k0] : 0.0f;
  }
#endif
}

// VNNI pairs: out[(p * 64 + j) * 2 + e] = w[j * ldw + 2p + e] for 2p + e < kc, else 0.
static void pack_bf16(const uint16_t* w, int64_t ldw, int nr, int64_t kc, uint16_t* out) {
  const int64_t kp = (kc + 1) / 2;
#ifdef RL_GEMM_AVX512
  for (int j0 = 0; j0 < kPanel; j0 += 16) {
    for (int64_t p0 = 0; p0 < kp; p0 += 16) {
      const int64_t kn = kc - 2 * p0 < 32 ? kc - 2 * p0 : 32;  // bf16 elements of this block
      const __mmask32 km = (__mmask32)(kn == 32 ? 0xffffffffu : (1u << kn) - 1u);
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < nr
                   ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(km, w + (j0 + i) * ldw + 2 * p0))
                   : _mm512_setzero_ps();
      transpose16(r);
      const int pn = (int)((kn + 1) / 2);
      for (int t = 0; t < pn; ++t)
        _mm512_storeu_ps((float*)(out + ((p0 + t) * kPanel + j0) * 2), r[t]);
    }
  }
#else
  for (int j0 = 0; j0 < kPanel; j0 += 8) {
    int64_t p0 = 0;
    for (; 2 * (p0 + 8) <= kc; p0 += 8) {  // 8 columns x 8 pairs, a pair as one 32-bit value
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = j0 + i < nr ? _mm256_castsi256_ps(_mm256_loadu_si256(
                                 (const __m256i*)(w + (j0 + i) * ldw + 2 * p0)))
                           : _mm256_setzero_ps();
      transpose8(r);
      for (int t = 0; t < 8; ++t)
        _mm256_storeu_ps((float*)(out + ((p0 + t) * kPanel + j0) * 2), r[t]);
    }
    for (int64_t p = p0; p < kp; ++p)
      for (int j = j0; j < j0 + 8; ++j)
        for (int e = 0; e < 2; ++e) {
          const int64_t k = 2 * p + e;
          out[(p * kPanel + j) * 2 + e] = (j < nr && k < kc) ? w[j * ldw + k] : (uint16_t)0;
        }
  }
#endif
}

// ----------------------------------------------------------------------------- micro-kernels

// Accumulators of MR rows x NV vectors (16 columns each) starting at column c0
// of y: +0 on the first K block, else what the previous block stored.
template <int MR, int NV>
static inline void acc_load(Vec16 (&acc)[MR][NV], const float* y, int64_t ldy, int cols,
                            bool first) {
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      const int c = cols - 16 * v;
      acc[i][v] = first || c <= 0 ? Vec16::zero()
                  : c >= 16       ? Vec16::load(y + i * ldy + 16 * v)
                                  : Vec16::load_n(y + i * ldy + 16 * v, c);
    }
}

template <int MR, int NV>
static inline void acc_store(const Vec16 (&acc)[MR][NV], float* y, int64_t ldy, int cols) {
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      const int c = cols - 16 * v;
      if (c >= 16)
        acc[i][v].store(y + i * ldy + 16 * v);
      else if (c > 0)
        acc[i][v].store_n(y + i * ldy + 16 * v, c);
    }
}

// Where and how the finished accumulators go (see the header).
struct GemmOut {
  void* out;          // nullptr: the fp32 accumulators are the result, no bias
  int64_t ldo;        // row stride of out (elements)
  int bf16;           // out (and bias) is bf16, else fp32
  const void* bias;   // (N,) in out's dtype, or nullptr
};

// Finished accumulators acc[i * lda + j] (i < mr, j < nc) -> out rows / cols
// (row0, col0) of o, column j taking bias[col0 + j].
static void finish_rows(const float* acc, int64_t lda, const GemmOut& o, int64_t row0,
                        int64_t col0, int64_t mr, int64_t nc) {
  if (o.out == nullptr) return;
  for (int64_t i = 0; i < mr; ++i) {
    const float* a = acc + i * lda;
    if (!o.bf16) {
      float* out = (float*)o.out + (row0 + i) * o.ldo + col0;
      const float* b = (const float*)o.bias + col0;
      for (int64_t j = 0; j < nc; j += 16) {
        const int c = (int)(nc - j < 16 ? nc - j : 16);
        Vec16 v = c == 16 ? Vec16::load(a + j) : Vec16::load_n(a + j, c);
        if (o.bias) v = v + (c == 16 ? Vec16::load(b + j) : Vec16::load_n(b + j, c));
        if (c == 16)
          v.store(out + j);
        else
          v.store_n(out + j, c);
      }
    } else {
      uint16_t* out = (uint16_t*)o.out + (row0 + i) * o.ldo + col0;
      const uint16_t* b = (const uint16_t*)o.bias + col0;
      for (int64_t j = 0; j < nc; j += 16) {
        const int c = (int)(nc - j < 16 ? nc - j : 16);
        if (c == 16) {  // full vector: straight to out (the same steps as the tail below)
          Vec16::load(a + j).store_bf16(out + j);
          if (o.bias) (Vec16::load_bf16(out + j) + Vec16::load_bf16(b + j)).store_bf16(out + j);
          continue;
        }
        uint16_t r[16];
        Vec16::load_n(a + j, c).store_bf16(r);
        if (o.bias) {
          uint16_t bb[16] = {0};
          for (int t = 0; t < c; ++t) bb[t] = b[j + t];
          (Vec16::load_bf16(r) + Vec16::load_bf16(bb)).store_bf16(r);
        }
        for (int t = 0; t < c; ++t) out[j + t] = r[t];
      }
    }
  }
}

// Speed only: the panel bytes kPrefetchBytes ahead of this step's (one 64-byte line per
// vector) asked into L1. Panels packed once lie one after another in the order a task
// reads them, so this streams the weight from memory while the chains run; with two or
// more rows the product per byte is slow enough for the hardware prefetcher to fall
// behind (measured: SmolLM2-135M's decode GEMMs at 8 rows, 14.5 -> 12.3 ms on streamed
// weights), while one row runs at the copy bandwidth without it.
constexpr int64_t kPrefetchBytes = 4096;
template <int MR, int NV, typename T>
static inline void prefetch_panel(const T* step) {
  if constexpr (MR >= 2)
    for (int v = 0; v < NV; ++v)
      _mm_prefetch((const char*)(step + 16 * v * (4 / sizeof(T))) + kPrefetchBytes, _MM_HINT_T0);
}

// MR rows x 16*NV columns of one panel (columns c0 ..), kc steps of the chain.
template <int MR, int NV>
static void micro_f32(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y,
                      int64_t ldy, int cols, bool first) {
  Vec16 acc[MR][NV];
  acc_load<MR, NV>(acc, y, ldy, cols, first);
  for (int64_t k = 0; k < kc; ++k) {
    Vec16 b[NV];
    prefetch_panel<MR, NV>(panel + k * kPanel);
    for (int v = 0; v < NV; ++v) b[v] = Vec16::load(panel + k * kPanel + 16 * v);
    for (int i = 0; i < MR; ++i) {
      const Vec16 a = Vec16::set1(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = fmadd(a, b[v], acc[i][v]);
    }
  }
  acc_store<MR, NV>(acc, y, ldy, cols);
}

#ifdef RL_BF16_DOT_HW
template <int MR, int NV>
static inline void bf16_pair_step(uint32_t (&xp)[MR], const uint16_t* pp, Vec16 (&acc)[MR][NV]) {
  __m512i b[NV];
  for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512((const void*)(pp + 32 * v));
  for (int i = 0; i < MR; ++i) {
    const __m512i a = _mm512_set1_epi32((int)xp[i]);
    for (int v = 0; v < NV; ++v)
      acc[i][v].v = _mm512_dpbf16_ps(acc[i][v].v, (__m512bh)a, (__m512bh)b[v]);
  }
}
#else
template <int MR, int NV>
static inline void bf16_pair_step(uint32_t (&xp)[MR], const uint16_t* pp, Vec16 (&acc)[MR][NV]) {
  PairsBf16 b[NV];
  for (int v = 0; v < NV; ++v) b[v] = PairsBf16::load(pp + 32 * v);
  for (int i = 0; i < MR; ++i) {
    const Vec16 ae = Vec16::set1(rl_bf16_to_f32((uint16_t)(xp[i] & 0xffffu)));
    const Vec16 ao = Vec16::set1(rl_bf16_to_f32((uint16_t)(xp[i] >> 16)));
    for (int v = 0; v < NV; ++v) {
      acc[i][v] = fmadd(ao, b[v].odd, acc[i][v]);  // VDPBF16PS order: element 2p+1, then 2p
      acc[i][v] = fmadd(ae, b[v].even, acc[i][v]);
    }
  }
}
#endif

template <int MR, int NV>
static void micro_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t kc, float* y,
                       int64_t ldy, int cols, bool first) {
  Vec16 acc[MR][NV];
  acc_load<MR, NV>(acc, y, ldy, cols, first);
  const int64_t full = kc / 2;
  uint32_t xp[MR];
  for (int64_t p = 0; p < full; ++p) {
    for (int i = 0; i < MR; ++i) xp[i] = rl_load_u32(x + i * ldx + 2 * p);
    const uint16_t* pp = panel + p * kPanel * 2;
    prefetch_panel<MR, NV>(pp);
    bf16_pair_step<MR, NV>(xp, pp, acc);
  }
  if (kc & 1) {  // odd K: the last pair is (x[K-1], +0)
    for (int i = 0; i < MR; ++i) xp[i] = x[i * ldx + kc - 1];
    bf16_pair_step<MR, NV>(xp, panel + full * kPanel * 2, acc);
  }
  acc_store<MR, NV>(acc, y, ldy, cols);
}

// ----------------------------------------------------------------------------- drivers

template <typename T>
struct GemmOps;
template <>
struct GemmOps<float> {
  static void pack(const float* w, int64_t ldw, int nr, int64_t kc, float* out) {
    pack_f32(w, ldw, nr, kc, out);
  }
  template <int MR, int NV>
  static void micro(const float* x, int64_t ldx, const float* p, int64_t kc, float* y,
                    int64_t ldy, int cols, bool first) {
    micro_f32<MR, NV>(x, ldx, p, kc, y, ldy, cols, first);
  }
  static constexpr int kColStride = 1;  // panel elements per column per k
};
template <>
struct GemmOps<uint16_t> {
  static void pack(const uint16_t* w, int64_t ldw, int nr, int64_t kc, uint16_t* out) {
    pack_bf16(w, ldw, nr, kc, out);
  }
  template <int MR, int NV>
  static void micro(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t kc, float* y,
                    int64_t ldy, int cols, bool first) {
    micro_bf16<MR, NV>(x, ldx, p, kc, y, ldy, cols, first);
  }
  static constexpr int kColStride = 2;  // a pair per column
};

// One panel (up to 64 columns) for mr <= MR_MAX rows: NV_MAX vectors at a time.
template <typename T, int MR>
static void panel_rows(int mr, const T* x, int64_t ldx, const T* p, int64_t kc, float* y,
                       int64_t ldy, int cols, bool first) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_rows<T, MR - 1>(mr, x, ldx, p, kc, y, ldy, cols, first);
  }
  for (int c0 = 0; c0 < kPanel && c0 < cols; c0 += 16 * NV_MAX)
    GemmOps<T>::template micro<MR, NV_MAX>(x, ldx, p + c0 * GemmOps<T>::kColStride, kc, y + c0,
                                           ldy, cols - c0, first);
}

// y block (M x N, row stride ldy) of x @ w^T, K in blocks of kb (even);
// scratch: gemm_scratch_bytes(kb). Per K block: the (up to) 4 panels of the
// block's columns, then each row tile (its x slice in L1) against them. The
// panels are packed here into scratch (they stay in L2), or, with `packed`,
// read from the weight's panels packed once by gemm_pack (layout only: the
// same panel contents, so the same chains and bits), where panel q of K block
// b is at packed + (q * nkb + b) * kPanel * kb (q counted from this block's
// first column, a multiple of kPanel).
template <typename T>
static void gemm_block(const T* x, int64_t ldx, const T* w, int64_t ldw, const T* packed,
                       int64_t nkb, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                       int64_t kb, T* scratch, const GemmOut& o) {
  const int64_t panel_elems = kPanel * kb;  // bf16: kb / 2 pairs of 2
  const T* panels[kBlockN / kPanel];
  for (int64_t n0 = 0; n0 < N; n0 += kBlockN) {
    const int64_t nb = N - n0 < kBlockN ? N - n0 : kBlockN;
    const int np = (int)((nb + kPanel - 1) / kPanel);
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
      const int64_t kc = K - k0 < kb ? K - k0 : kb;
      for (int p = 0; p < np; ++p) {
        if (packed != nullptr) {
          panels[p] = packed + ((n0 / kPanel + p) * nkb + k0 / kb) * panel_elems;
          continue;
        }
        const int nr = (int)(nb - p * kPanel < kPanel ? nb - p * kPanel : kPanel);
        GemmOps<T>::pack(w + (n0 + p * kPanel) * ldw + k0, ldw, nr, kc, scratch + p * panel_elems);
        panels[p] = scratch + p * panel_elems;
      }
      for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int mr = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
        for (int p = 0; p < np; ++p) {
          const int nr = (int)(nb - p * kPanel < kPanel ? nb - p * kPanel : kPanel);
          panel_rows<T, MR_MAX>(mr, x + m0 * ldx + k0, ldx, panels[p], kc,
                                y + m0 * ldy + n0 + p * kPanel, ldy, nr, k0 == 0);
        }
        if (k0 + kc >= K) finish_rows(y + m0 * ldy + n0, ldy, o, m0, n0, mr, nb);
      }
    }
  }
}

// The panels gemm_block reads, for all of w (N x K), packed once: panel q
// (columns 64q ..) of K block b at out + (q * nkb + b) * kPanel * kb, nkb =
// ceil(K / kb); columns past N are zeros (as pack writes them) and so is the
// unused end of a short last K block (never read; zeroed so that the packed
// bytes are a function of w alone).
template <typename T>
static void gemm_pack_all(const T* w, int64_t ldw, int64_t N, int64_t K, int64_t kb, T* out) {
  const int64_t nkb = (K + kb - 1) / kb;
  for (int64_t q = 0; q * kPanel < N; ++q) {
    const int nr = (int)(N - q * kPanel < kPanel ? N - q * kPanel : kPanel);
    for (int64_t b = 0; b < nkb; ++b) {
      const int64_t kc = K - b * kb < kb ? K - b * kb : kb;
      T* panel = out + (q * nkb + b) * kPanel * kb;
      GemmOps<T>::pack(w + q * kPanel * ldw + b * kb, ldw, nr, kc, panel);
      // elements written: kc rows (fp32) or ceil(kc / 2) pairs (bf16) of kPanel columns
      const int64_t used = (GemmOps<T>::kColStride == 2 ? (kc + 1) / 2 * 2 : kc) * kPanel;
      for (int64_t e = used; e < kPanel * kb; ++e) panel[e] = (T)0;
    }
  }
}

void gemm_pack_f32(const float* w, int64_t ldw, int64_t N, int64_t K, int64_t kb, float* out) {
  gemm_pack_all<float>(w, ldw, N, K, kb, out);
}
void gemm_pack_bf16(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, int64_t kb,
                    uint16_t* out) {
  gemm_pack_all<uint16_t>(w, ldw, N, K, kb, out);
}

int64_t gemm_scratch_bytes(int64_t kb) { return kBlockN * kb * 4; }

#ifdef RL_GEMM_AVX512
// M <= 2 (decode), fp32: the same serial chain per output, without the packed
// panel: 16 outputs at a time, each 16 x 16 block of w transposed in registers
// and used at once by the MR rows, the accumulators kept in registers over all
// of K (no panel stores and reloads, no y reload between K blocks).
template <int MR>
static void gemv_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                     int64_t ldy, int64_t N, int64_t K) {
  for (int64_t j0 = 0; j0 < N; j0 += 16) {
    const int nr = (int)(N - j0 < 16 ? N - j0 : 16);
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const int kn = (int)(K - k0 < 16 ? K - k0 : 16);
      const __mmask16 km = (__mmask16)((1u << kn) - 1u);
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < nr ? _mm512_maskz_loadu_ps(km, w + (j0 + i) * ldw + k0) : _mm512_setzero_ps();
      transpose16(r);
      if (kn == 16) {
        for (int t = 0; t < 16; ++t)
          for (int i = 0; i < MR; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k0 + t]), r[t], acc[i]);
      } else {
        for (int t = 0; t < kn; ++t)
          for (int i = 0; i < MR; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k0 + t]), r[t], acc[i]);
      }
    }
    for (int i = 0; i < MR; ++i)
      _mm512_mask_storeu_ps(y + i * ldy + j0, (__mmask16)((1u << nr) - 1u), acc[i]);
  }
}
#endif

#ifndef RL_GEMM_AVX512
// M <= 4 (decode), AVX2: the same serial chain per output without the packed
// panel: 8 outputs at a time, each 8 x 8 block of w transposed in registers
// and used at once by the MR rows, the accumulators kept in registers over
// all of K (the packing the panel path pays once per call would cost as much
// as the whole product at these M).
template <int MR>
static void gemv_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                     int64_t ldy, int64_t N, int64_t K) {
  for (int64_t j0 = 0; j0 < N; j0 += 8) {
    const int nr = (int)(N - j0 < 8 ? N - j0 : 8);
    const float* wj = w + j0 * ldw;
    __m256 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    int64_t k0 = 0;
    for (; k0 + 8 <= K; k0 += 8) {
      __m256 r[8];
      load_rows8(wj, ldw, 0, nr, k0, r);
      transpose8(r);
      for (int t = 0; t < 8; ++t)
        for (int i = 0; i < MR; ++i)
          acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(x[i * ldx + k0 + t]), r[t], acc[i]);
    }
    if (k0 < K) {  // the last K % 8 steps, the same chain
      const int kn = (int)(K - k0);
      const __m256i km = rl_mask8(kn);
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = i < nr ? _mm256_maskload_ps(wj + i * ldw + k0, km) : _mm256_setzero_ps();
      transpose8(r);
      for (int t = 0; t < kn; ++t)
        for (int i = 0; i < MR; ++i)
          acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(x[i * ldx + k0 + t]), r[t], acc[i]);
    }
    for (int i = 0; i < MR; ++i) _mm256_maskstore_ps(y + i * ldy + j0, rl_mask8(nr), acc[i]);
  }
}

// One step of 8 bf16 pairs (16 elements at x + 2 * p0) for MR rows against 8
// transposed columns r[t] (pair t of each column as one 32-bit value): the
// FMA emulation of VDPBF16PS, element 2p+1 first, then 2p (bf16_pair_step).
template <int MR>
static inline void gemv_bf16_pairs(const uint16_t* x, int64_t ldx, int64_t k0, int pairs,
                                   const __m256 r[8], __m256 (&acc)[MR]) {
  const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
  for (int t = 0; t < pairs; ++t) {
    const __m256i b = _mm256_castps_si256(r[t]);
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(b, hi_mask));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    for (int i = 0; i < MR; ++i) {
      const uint16_t* xi = x + i * ldx + k0 + 2 * t;
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(rl_bf16_to_f32(xi[1])), odd, acc[i]);
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(rl_bf16_to_f32(xi[0])), even, acc[i]);
    }
  }
}

// M <= 4 (decode), bf16 without VDPBF16PS (AVX2): as gemv_f32, pairs in
// increasing order; the K % 16 tail runs on zero-padded copies (an odd K's
// last pair is (x[K-1], +0), as in the packed panel).
template <int MR>
static void gemv_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
                      int64_t ldy, int64_t N, int64_t K) {
  for (int64_t j0 = 0; j0 < N; j0 += 8) {
    const int nr = (int)(N - j0 < 8 ? N - j0 : 8);
    const uint16_t* wj = w + j0 * ldw;
    __m256 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    int64_t k0 = 0;
    for (; k0 + 16 <= K; k0 += 16) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = i < nr ? _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(wj + i * ldw + k0)))
                      : _mm256_setzero_ps();
      transpose8(r);
      gemv_bf16_pairs<MR>(x, ldx, k0, 8, r, acc);
    }
    if (k0 < K) {
      const int kn = (int)(K - k0);
      alignas(32) uint16_t wt[8][16] = {}, xt[MR][16] = {};
      for (int i = 0; i < nr; ++i)
        for (int e = 0; e < kn; ++e) wt[i][e] = wj[i * ldw + k0 + e];
      for (int i = 0; i < MR; ++i)
        for (int e = 0; e < kn; ++e) xt[i][e] = x[i * ldx + k0 + e];
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_castsi256_ps(_mm256_load_si256((const __m256i*)wt[i]));
      transpose8(r);
      gemv_bf16_pairs<MR>(&xt[0][0], 16, 0, (kn + 1) / 2, r, acc);
    }
    for (int i = 0; i < MR; ++i) _mm256_maskstore_ps(y + i * ldy + j0, rl_mask8(nr), acc[i]);
  }
}

template <typename T, int MR>
static void gemv_rows(int64_t M, const T* x, int64_t ldx, const T* w, int64_t ldw, float* y,
                      int64_t ldy, int64_t N, int64_t K) {
  if constexpr (MR > 1) {
    if (M < MR) return gemv_rows<T, MR - 1>(M, x, ldx, w, ldw, y, ldy, N, K);
  }
  if constexpr (sizeof(T) == 4) gemv_f32<MR>(x, ldx, w, ldw, y, ldy, N, K);
  else gemv_bf16<MR>(x, ldx, w, ldw, y, ldy, N, K);
}
constexpr int64_t kGemvRows = 4;  // AVX2: M up to this skips packing (speed only)
#endif

// y: the fp32 accumulators (M x N, row stride ldy); with out != nullptr the
// result goes to out (row0 / col0: where this block starts in out and bias).
void gemm_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
              int64_t M, int64_t N, int64_t K, int64_t kb, void* scratch, void* out,
              int64_t ldo, int out_bf16, const void* bias) {
  const GemmOut o{out, ldo, out_bf16, bias};
#ifdef RL_GEMM_AVX512
  if (M <= 2) {
    if (M == 1) gemv_f32<1>(x, ldx, w, ldw, y, ldy, N, K);
    else gemv_f32<2>(x, ldx, w, ldw, y, ldy, N, K);
    return finish_rows(y, ldy, o, 0, 0, M, N);
  }
#else
  if (M <= kGemvRows) {
    gemv_rows<float, kGemvRows>(M, x, ldx, w, ldw, y, ldy, N, K);
    return finish_rows(y, ldy, o, 0, 0, M, N);
  }
#endif
  gemm_block<float>(x, ldx, w, ldw, nullptr, 0, y, ldy, M, N, K, kb, (float*)scratch, o);
}

void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
               int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t kb, void* scratch, void* out,
               int64_t ldo, int out_bf16, const void* bias) {
  const GemmOut o{out, ldo, out_bf16, bias};
#ifndef RL_GEMM_AVX512
  if (M <= kGemvRows) {
    gemv_rows<uint16_t, kGemvRows>(M, x, ldx, w, ldw, y, ldy, N, K);
    return finish_rows(y, ldy, o, 0, 0, M, N);
  }
#endif
  gemm_block<uint16_t>(x, ldx, w, ldw, nullptr, 0, y, ldy, M, N, K, kb, (uint16_t*)scratch, o);
}

// As gemm_f32 / gemm_bf16 on w's panels packed by gemm_pack_* (the block's
// first panel at `packed`, nkb K blocks of kb a panel), for every M: the panel
// path's chains are those of the gemv paths above, so the bits are the same.
void gemm_packed_f32(const float* x, int64_t ldx, const float* packed, int64_t nkb, float* y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t kb, void* out,
                     int64_t ldo, int out_bf16, const void* bias) {
  const GemmOut o{out, ldo, out_bf16, bias};
  gemm_block<float>(x, ldx, nullptr, 0, packed, nkb, y, ldy, M, N, K, kb, nullptr, o);
}

void gemm_packed_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t nkb,
                      float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t kb,
                      void* out, int64_t ldo, int out_bf16, const void* bias) {
  const GemmOut o{out, ldo, out_bf16, bias};
  gemm_block<uint16_t>(x, ldx, nullptr, 0, packed, nkb, y, ldy, M, N, K, kb, nullptr, o);
}
