// Mixture-of-experts experts forward in one call (included by bindings.cpp after `gemm`).
//
// The Python side (rl_engine/kernels/common/moe_experts.py) groups the (token,
// slot) pairs by expert and passes: the token of every grouped row, the
// (expert, start, stop) span of every expert with rows, each row's routing
// weight and each token's rows in ascending expert order. This computes, with
// the bits of the op's plain composition of cpp `linear` and `silu`:
//   gu  = x[rows] @ gate_up[e]^T          the GEMM kernels (serial K chain), model dtype
//   act = silu(gu[:, :I]) * gu[:, I:]     the silu kernels, then one rounded product
//   y   = act @ down[e]^T                 the GEMM kernels, model dtype
//   z   = round(float(y) * float(w))      HF's (y * w).to(dtype), w bf16 or fp32
//   out[t] = ((0 + z[r0]) + z[r1]) + ...  ascending expert index, one rounding per add
// Threads split GEMM output blocks (of every expert at once) and rows, never a
// reduction: the thread count cannot change a bit. Only the Python per-expert
// loop is gone (tens of small torch calls per expert at decode sizes).

namespace moe {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even (c10::BFloat16's steps; NaN -> 0x7fc0, as the cpp kernels).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Element i of a row in the model dtype, as float / stored back with one rounding.
struct Elem {
  bool bf16;
  float get(const void* p, int64_t i) const {
    return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  void set(void* p, int64_t i, float v) const {
    if (bf16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
    else static_cast<float*>(p)[i] = v;
  }
};

// One GEMM task: rows [m0, m0 + m) of group g against output columns [n0, n0 + n).
struct Task {
  int64_t group, m0, n0, m, n;
};

// out (S, N) model dtype = x (S, K) @ w[e]^T for every group's rows, w (E, N, K).
void grouped_gemm(const Kernels& k, const at::Tensor& x, const at::Tensor& w,
                  const std::vector<std::array<int64_t, 3>>& spans, at::Tensor& out, bool bf16) {
  const int64_t K = x.size(1), N = w.size(1);
  std::vector<Task> tasks;
  for (int64_t g = 0; g < (int64_t)spans.size(); ++g) {
    const int64_t M = spans[g][2] - spans[g][1];
    const int64_t rows = M <= kSmallM ? M : kTaskRows;
    const int64_t cols = M <= kSmallM ? kSmallTaskCols : kTaskCols;
    for (int64_t m0 = 0; m0 < M; m0 += rows)
      for (int64_t n0 = 0; n0 < N; n0 += cols)
        tasks.push_back({g, m0, n0, std::min(rows, M - m0), std::min(cols, N - n0)});
  }
  const int64_t kmax = bf16 ? kBlockKBf16 : kBlockKF32;
  const int64_t nkb = (K + kmax - 1) / kmax;
  const int64_t kb = std::min(kmax, ((K + nkb - 1) / nkb + 1) / 2 * 2);
  const int64_t pack_bytes = (k.gemm_scratch_bytes(kb) + 63) / 64 * 64;
  const int64_t acc_bytes = bf16 ? kTaskRows * kTaskCols * 4 : 0;
  const int64_t scratch_bytes = pack_bytes + acc_bytes;
  at::Tensor scratch =
      at::empty({at::get_num_threads(), scratch_bytes}, x.options().dtype(at::kByte));
  const int64_t esize = bf16 ? 2 : 4;
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(w.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  parallel_tasks((int64_t)tasks.size(), [&](int64_t t) {
    const Task& task = tasks[t];
    const int64_t expert = spans[task.group][0], row0 = spans[task.group][1] + task.m0;
    uint8_t* scr = scratch.data_ptr<uint8_t>() + at::get_thread_num() * scratch_bytes;
    const char* xb = xp + row0 * K * esize;
    const char* wb = wp + (expert * N + task.n0) * K * esize;
    void* ob = op + (row0 * N + task.n0) * esize;
    if (bf16) {
      float* acc = reinterpret_cast<float*>(scr + pack_bytes);  // (m, n), row stride kTaskCols
      k.gemm_bf16(reinterpret_cast<const uint16_t*>(xb), K, reinterpret_cast<const uint16_t*>(wb),
                  K, acc, kTaskCols, task.m, task.n, K, kb, scr, ob, N, 1, nullptr);
    } else {
      k.gemm_f32(reinterpret_cast<const float*>(xb), K, reinterpret_cast<const float*>(wb), K,
                 static_cast<float*>(ob), N, task.m, task.n, K, kb, scr, nullptr, N, 0, nullptr);
    }
  });
}

// act (S, I) = silu(gu[:, :I]) * gu[:, I:], row by row.
void gated_silu(const Kernels& k, const at::Tensor& gu, at::Tensor& act, bool bf16) {
  const int64_t S = gu.size(0), I = act.size(1);
  const Elem e{bf16};
  const int64_t esize = bf16 ? 2 : 4;
  const char* gp = static_cast<const char*>(gu.data_ptr());
  char* ap = static_cast<char*>(act.data_ptr());
  at::parallel_for(0, S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const char* row = gp + r * 2 * I * esize;
      char* a = ap + r * I * esize;
      if (bf16)
        k.silu_bf16(reinterpret_cast<const uint16_t*>(row), reinterpret_cast<uint16_t*>(a), I);
      else
        k.silu_f32(reinterpret_cast<const float*>(row), reinterpret_cast<float*>(a), I);
      for (int64_t i = 0; i < I; ++i) e.set(a, i, e.get(a, i) * e.get(row, I + i));
    }
  });
}

}  // namespace moe

// hidden (N, H), gate_up (E, 2I, H), down (E, H, I): contiguous, one dtype (fp32 / bf16).
// tokens (S,), spans (G, 3), combine_rows (N, k): int64; pair_weights (S,): model dtype or fp32.
// -> [out (N, H)] and, with keep, [out, gate_up output (S, 2I), down output (S, H)].
std::vector<at::Tensor> moe_experts(const at::Tensor& hidden, const at::Tensor& gate_up,
                                    const at::Tensor& down, const at::Tensor& tokens,
                                    const at::Tensor& spans_in, const at::Tensor& pair_weights,
                                    const at::Tensor& combine_rows, const std::string& isa,
                                    bool keep) {
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "hidden must be float32 or bfloat16");
  TORCH_CHECK(gate_up.scalar_type() == dtype && down.scalar_type() == dtype,
              "gate_up and down must have hidden's dtype");
  TORCH_CHECK(hidden.is_contiguous() && gate_up.is_contiguous() && down.is_contiguous(),
              "hidden, gate_up and down must be contiguous");
  TORCH_CHECK(pair_weights.scalar_type() == dtype || pair_weights.scalar_type() == at::kFloat,
              "pair_weights must be the model dtype or float32");
  const Kernels& k = kernels_for(isa);
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t N = hidden.size(0), H = hidden.size(1), I = down.size(2);
  const int64_t S = tokens.size(0), top_k = combine_rows.size(1);
  const at::Tensor spans_c = spans_in.contiguous();
  std::vector<std::array<int64_t, 3>> spans(spans_c.size(0));
  for (int64_t g = 0; g < spans_c.size(0); ++g)
    for (int c = 0; c < 3; ++c) spans[g][c] = spans_c[g][c].item<int64_t>();
  const int64_t esize = bf16 ? 2 : 4;

  at::Tensor x = at::empty({S, H}, hidden.options());  // the grouped rows' hidden states
  {
    const int64_t* tp = tokens.contiguous().data_ptr<int64_t>();
    const char* hp = static_cast<const char*>(hidden.data_ptr());
    char* xp = static_cast<char*>(x.data_ptr());
    at::parallel_for(0, S, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        std::memcpy(xp + r * H * esize, hp + tp[r] * H * esize, H * esize);
    });
  }
  at::Tensor gu = at::empty({S, 2 * I}, hidden.options());
  moe::grouped_gemm(k, x, gate_up, spans, gu, bf16);
  x = at::Tensor();  // free before the next buffers
  at::Tensor act = at::empty({S, I}, hidden.options());
  moe::gated_silu(k, gu, act, bf16);
  at::Tensor y = at::empty({S, H}, hidden.options());
  moe::grouped_gemm(k, act, down, spans, y, bf16);
  act = at::Tensor();

  at::Tensor z = keep ? at::empty({S, H}, hidden.options()) : y;  // scaled rows (in place without keep)
  {
    const moe::Elem e{bf16};
    const at::Tensor w = pair_weights.contiguous();
    const bool w_bf16 = w.scalar_type() == at::kBFloat16;
    const moe::Elem ew{w_bf16};
    const char* yp = static_cast<const char*>(y.data_ptr());
    char* zp = static_cast<char*>(z.data_ptr());
    const void* wp = w.data_ptr();
    at::parallel_for(0, S, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float wr = ew.get(wp, r);
        for (int64_t h = 0; h < H; ++h)
          e.set(zp + r * H * esize, h, e.get(yp + r * H * esize, h) * wr);
      }
    });
  }
  at::Tensor out = at::empty({N, H}, hidden.options());
  {
    const moe::Elem e{bf16};
    const at::Tensor rows = combine_rows.contiguous();
    const int64_t* rp = rows.data_ptr<int64_t>();
    const char* zp = static_cast<const char*>(z.data_ptr());
    char* op = static_cast<char*>(out.data_ptr());
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(H);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < top_k; ++j) {  // ascending expert index
          const char* zr = zp + rp[t * top_k + j] * H * esize;
          for (int64_t h = 0; h < H; ++h) {
            const float sum = acc[h] + e.get(zr, h);
            acc[h] = bf16 ? moe::bf16_to_f32(moe::f32_to_bf16(sum)) : sum;
          }
        }
        for (int64_t h = 0; h < H; ++h) e.set(op + t * H * esize, h, acc[h]);
      }
    });
  }
  if (!keep) return {out};
  return {out, gu, y};
}
