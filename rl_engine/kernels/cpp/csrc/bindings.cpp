// Torch-facing side of the fixed-order CPU kernels: checks, ISA dispatch and
// threading. Threads only ever split output rows / columns (or whole query
// rows), never a reduction, so the bits do not depend on the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <atomic>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

struct Kernels {
  decltype(&rl_avx2::gemm_scratch_bytes) gemm_scratch_bytes;
  decltype(&rl_avx2::gemm_f32) gemm_f32;
  decltype(&rl_avx2::gemm_bf16) gemm_bf16;
  decltype(&rl_avx2::gemm_pack_f32) gemm_pack_f32;
  decltype(&rl_avx2::gemm_pack_bf16) gemm_pack_bf16;
  decltype(&rl_avx2::gemm_packed_f32) gemm_packed_f32;
  decltype(&rl_avx2::gemm_packed_bf16) gemm_packed_bf16;
  decltype(&rl_avx2::silu_f32) silu_f32;
  decltype(&rl_avx2::silu_bf16) silu_bf16;
  decltype(&rl_avx2::attention_block) attention_block;
};

#define RL_KERNELS(ns) \
  Kernels { ns::gemm_scratch_bytes, ns::gemm_f32, ns::gemm_bf16, ns::gemm_pack_f32,  \
            ns::gemm_pack_bf16, ns::gemm_packed_f32, ns::gemm_packed_bf16, ns::silu_f32, \
            ns::silu_bf16, ns::attention_block }

// ISA names as the Python side spells them (RL_ENGINE_CPU_ISA).
bool isa_supported(const std::string& isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return avx2;
  if (isa == "avx512") return avx512;
  if (isa == "avx512_bf16") return avx512 && __builtin_cpu_supports("avx512bf16");
  return false;
}

const Kernels& kernels_for(const std::string& isa) {
  static const Kernels avx2 = RL_KERNELS(rl_avx2);
  static const Kernels avx512 = RL_KERNELS(rl_avx512);
  static const Kernels avx512_bf16 = RL_KERNELS(rl_avx512_bf16);
  TORCH_CHECK(isa_supported(isa), "CPU instruction set '", isa,
              "' is not supported by this CPU (or unknown); known: avx2, avx512, avx512_bf16");
  if (isa == "avx2") return avx2;
  if (isa == "avx512") return avx512;
  return avx512_bf16;
}

void check_rows(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), " dims");
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, name, " must have unit stride along K");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// Output blocks handed to one task (speed only: a block never splits a dot
// product, whose chain runs over all of K inside one task). Small M (decode):
// one 64-column panel per task, every row, so the weight is read once. Large
// M: kTaskRows x kTaskCols blocks, the packed weight block reused by all rows.
constexpr int64_t kSmallM = 64;
constexpr int64_t kTaskRows = 480;  // a multiple of the 6-row register tile
constexpr int64_t kTaskCols = 256;
constexpr int64_t kSmallTaskCols = 64;
// K per packed weight block (bf16: even, so a pair never straddles two blocks).
// Between blocks the fp32 accumulators are stored to y and reloaded: exact.
constexpr int64_t kBlockKF32 = 256;
constexpr int64_t kBlockKBf16 = 512;

// The output block of one task. Large M: kTaskRows x kTaskCols, halved (columns down
// to one panel, then rows down to kMinTaskRows) while there are fewer than
// kTasksPerThread tasks a thread: a prefill's k / v / o projections (N of a few
// hundred) would otherwise leave a thread idle. Small M: one panel, every row.
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kMinTaskRows = 60;  // a multiple of every ISA's register tile rows
struct TaskBlock {
  int64_t rows, cols;
};
TaskBlock task_block(int64_t M, int64_t N) {
  if (M <= kSmallM) return {M, kSmallTaskCols};
  const int64_t wanted = kTasksPerThread * at::get_num_threads();
  int64_t rows = kTaskRows, cols = kTaskCols;
  const auto tasks = [&] { return ((M + rows - 1) / rows) * ((N + cols - 1) / cols); };
  while (cols > kSmallTaskCols && tasks() < wanted) cols /= 2;
  while (rows > kMinTaskRows && tasks() < wanted) rows /= 2;
  return {rows, cols};
}

// Runs fn(t) for t in [0, n) on the intra-op threads, each thread claiming the
// next task from a shared counter (dynamic: a descheduled thread on a busy
// machine does not hold back a fixed share). Speed only: tasks are independent.
template <typename F>
void parallel_tasks(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(t);
  });
}


// K per packed weight block for a K of this length: balanced blocks (even), at
// most kBlockKF32 / kBlockKBf16 long. Speed only; a packed weight records it.
int64_t gemm_k_block(int64_t K, bool bf16) {
  if (K <= 0) return 2;  // nothing to pack (and no division by zero blocks)
  const int64_t kmax = bf16 ? kBlockKBf16 : kBlockKF32;
  const int64_t nkb = (K + kmax - 1) / kmax;
  return std::min(kmax, ((K + nkb - 1) / nkb + 1) / 2 * 2);
}

// Elements of w (N, K) packed once into gemm_block's panels (gemm_pack).
int64_t gemm_packed_numel(int64_t N, int64_t K, bool bf16) {
  const int64_t kb = gemm_k_block(K, bf16);
  const int64_t panels = (N + kSmallTaskCols - 1) / kSmallTaskCols;
  return panels * ((K + kb - 1) / kb) * kSmallTaskCols * kb;
}

// The output (M, N) of x @ w^T (+ bias), w given as its rows (wp, row stride
// ldw) or, with packed != nullptr, as its panels packed by gemm_pack.
at::Tensor gemm_run(const Kernels& k, const at::Tensor& x, const void* wp, int64_t ldw,
                    const void* packed, int64_t N, const c10::optional<at::Tensor>& bias,
                    bool out_bf16) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto out_type = out_bf16 ? at::kBFloat16 : at::kFloat;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                "bias must be contiguous of shape (", N, ")");
    TORCH_CHECK(bias->scalar_type() == out_type, "bias must be ", out_type, ", got ",
                bias->scalar_type());
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_type));
  if (M == 0 || N == 0) return out;
  if (K == 0) {  // the empty chain is +0; then the output steps
    at::Tensor z = at::zeros({M, N}, x.options().dtype(at::kFloat)).to(out_type);
    return has_bias ? z + *bias : z;
  }
  const TaskBlock block = task_block(M, N);
  const int64_t rows = block.rows, cols = block.cols;
  const int64_t mt = (M + rows - 1) / rows, nt = (N + cols - 1) / cols;
  const int64_t ldx = x.stride(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.data_ptr();
  const int64_t kb = gemm_k_block(K, bf16);
  const int64_t nkb = (K + kb - 1) / kb;
  const int64_t panel_bytes = kSmallTaskCols * kb * (bf16 ? 2 : 4);
  const int64_t pack_bytes = packed ? 0 : (k.gemm_scratch_bytes(kb) + 63) / 64 * 64;
  // bf16 out: the fp32 accumulators of a task's block live in per-thread
  // scratch (rows x cols, row stride cols); fp32 out: in the output itself.
  const int64_t acc_bytes = out_bf16 ? rows * cols * 4 : 0;
  const int64_t scratch_bytes = std::max<int64_t>(pack_bytes + acc_bytes, 1);
  at::Tensor scratch = at::empty({at::get_num_threads(), scratch_bytes}, x.options().dtype(at::kByte));
  const int64_t esize = out_bf16 ? 2 : 4;
  char* op = static_cast<char*>(out.data_ptr());
  const char* bp = has_bias ? static_cast<const char*>(bias->data_ptr()) : nullptr;
  parallel_tasks(mt * nt, [&](int64_t t) {
    uint8_t* scr = scratch.data_ptr<uint8_t>() + at::get_thread_num() * scratch_bytes;
    const int64_t m0 = (t / nt) * rows, n0 = (t % nt) * cols;
    const int64_t m = std::min(rows, M - m0), n = std::min(cols, N - n0);
    void* ob = op + (m0 * N + n0) * esize;
    float* y = out_bf16 ? reinterpret_cast<float*>(scr + pack_bytes) : static_cast<float*>(ob);
    const int64_t ldy = out_bf16 ? cols : N;
    void* fin = (out_bf16 || has_bias) ? ob : nullptr;
    const void* bb = has_bias ? bp + n0 * esize : nullptr;
    // this task's first panel: columns n0 .. (n0 is a multiple of kSmallTaskCols)
    const char* pp = packed ? static_cast<const char*>(packed) + (n0 / kSmallTaskCols) * nkb * panel_bytes
                            : nullptr;
    if (bf16) {
      const auto* xb = static_cast<const uint16_t*>(xp) + m0 * ldx;
      if (pp) {
        k.gemm_packed_bf16(xb, ldx, reinterpret_cast<const uint16_t*>(pp), nkb, y, ldy, m, n, K,
                           kb, fin, N, out_bf16, bb);
      } else {
        const auto* wb = static_cast<const uint16_t*>(wp) + n0 * ldw;
        k.gemm_bf16(xb, ldx, wb, ldw, y, ldy, m, n, K, kb, scr, fin, N, out_bf16, bb);
      }
    } else {
      const auto* xf = static_cast<const float*>(xp) + m0 * ldx;
      if (pp) {
        k.gemm_packed_f32(xf, ldx, reinterpret_cast<const float*>(pp), nkb, y, ldy, m, n, K, kb,
                          fin, N, out_bf16, bb);
      } else {
        const auto* wf = static_cast<const float*>(wp) + n0 * ldw;
        k.gemm_f32(xf, ldx, wf, ldw, y, ldy, m, n, K, kb, scr, fin, N, out_bf16, bb);
      }
    }
  });
  return out;
}

}  // namespace

// x (M, K) @ w (N, K)^T -> (M, N), float32 (or bfloat16 with out_bf16), plus
// bias (N,) when given (in the output dtype). Bits: those of the fp32 result
// `.to(out dtype)`, then `+ bias` in the output dtype (gemm_impl.h, GemmOut).
at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, const std::string& isa,
                const c10::optional<at::Tensor>& bias, bool out_bf16) {
  check_rows("x", x);
  check_rows("weight", w);
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x is ", x.scalar_type(), " but weight is ",
              w.scalar_type());
  TORCH_CHECK(x.size(1) == w.size(1), "x has K=", x.size(1), " but weight has K=", w.size(1));
  return gemm_run(kernels_for(isa), x, w.data_ptr(), w.stride(0), nullptr, w.size(0), bias,
                  out_bf16);
}

// w (N, K) packed once into the panels `gemm_packed` reads: a 1-D tensor of w's
// dtype (layout only; the same on every ISA path). Its contents are a copy:
// a later change to w is not seen, so the caller owns when it is stale.
// With `out` (a buffer of the packed size and dtype) it is packed into out, in place.
at::Tensor gemm_pack(const at::Tensor& w, const std::string& isa,
                     const c10::optional<at::Tensor>& out) {
  check_rows("weight", w);
  const Kernels& k = kernels_for(isa);
  const int64_t N = w.size(0), K = w.size(1);
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const int64_t numel = gemm_packed_numel(N, K, bf16);
  at::Tensor packed;
  if (out.has_value() && out->defined()) {
    TORCH_CHECK(out->dim() == 1 && out->is_contiguous() && out->numel() == numel &&
                    out->scalar_type() == w.scalar_type(),
                "out must be a contiguous 1-D ", w.scalar_type(), " tensor of ", numel,
                " elements (the packed size of a (", N, ", ", K, ") weight)");
    packed = *out;
  } else {
    packed = numel == 0 ? at::zeros({0}, w.options()) : at::empty({numel}, w.options());
  }
  if (N == 0 || K == 0) return packed;
  const int64_t kb = gemm_k_block(K, bf16);
  const int64_t nkb = (K + kb - 1) / kb;
  const int64_t panel_elems = kSmallTaskCols * kb;
  const int64_t panels = (N + kSmallTaskCols - 1) / kSmallTaskCols;
  const int64_t ldw = w.stride(0);
  // one task per panel (all of its K blocks): threads only split columns
  parallel_tasks(panels, [&](int64_t q) {
    const int64_t n0 = q * kSmallTaskCols, n = std::min(kSmallTaskCols, N - n0);
    if (bf16) {
      k.gemm_pack_bf16(static_cast<const uint16_t*>(w.data_ptr()) + n0 * ldw, ldw, n, K, kb,
                       static_cast<uint16_t*>(packed.data_ptr()) + q * nkb * panel_elems);
    } else {
      k.gemm_pack_f32(static_cast<const float*>(w.data_ptr()) + n0 * ldw, ldw, n, K, kb,
                      packed.data_ptr<float>() + q * nkb * panel_elems);
    }
  });
  return packed;
}

// As `gemm`, with w (N, K) given as `gemm_pack(w)`: the same bits for every M.
at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::string& isa, const c10::optional<at::Tensor>& bias,
                       bool out_bf16) {
  check_rows("x", x);
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous(), "packed weight must be 1-D contiguous");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x is ", x.scalar_type(),
              " but the packed weight is ", packed.scalar_type());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(N >= 0 && packed.numel() == gemm_packed_numel(N, x.size(1), bf16),
              "the packed weight does not hold a (", N, ", ", x.size(1), ") weight");
  return gemm_run(kernels_for(isa), x, nullptr, 0, packed.data_ptr(), N, bias, out_bf16);
}

#include "moe_impl.h"  // moe_experts: the experts of a mixture-of-experts block in one call

// Elementwise SiLU, same dtype out. Every element goes through the same vector code.
at::Tensor silu(const at::Tensor& x_in, const std::string& isa) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x_in.scalar_type());
  const Kernels& k = kernels_for(isa);
  at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.numel();
  constexpr int64_t kChunk = 1 << 14;  // multiple of 16: chunk borders never split a vector
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.data_ptr();
  void* yp = y.data_ptr();
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kChunk, hi = std::min(n, end * kChunk);
    if (bf16) {
      k.silu_bf16(static_cast<const uint16_t*>(xp) + lo, static_cast<uint16_t*>(yp) + lo, hi - lo);
    } else {
      k.silu_f32(static_cast<const float*>(xp) + lo, static_cast<float*>(yp) + lo, hi - lo);
    }
  });
  return y;
}

// Key packing and value widening of the attention kernels (csrc/attention_impl.h), per ISA.
#define RL_DECLARE_ATTENTION_PACKING(ns)                                                   \
  namespace ns {                                                                           \
  void attention_pack_keys(const float* k, int64_t n, int64_t D, float* kt);               \
  void attention_pack_keys_bf16(const uint16_t* k, int64_t n, int64_t D, float* kt);       \
  void attention_widen_bf16(const uint16_t* x, int64_t n, float* y);                       \
  }
RL_DECLARE_ATTENTION_PACKING(rl_avx2)
RL_DECLARE_ATTENTION_PACKING(rl_avx512)
RL_DECLARE_ATTENTION_PACKING(rl_avx512_bf16)

namespace {
struct AttentionPacking {
  decltype(&rl_avx2::attention_pack_keys) pack_f32;
  decltype(&rl_avx2::attention_pack_keys_bf16) pack_bf16;
  decltype(&rl_avx2::attention_widen_bf16) widen_bf16;
};
#define RL_ATTENTION_PACKING(ns) \
  AttentionPacking { ns::attention_pack_keys, ns::attention_pack_keys_bf16, ns::attention_widen_bf16 }
const AttentionPacking& attention_packing_for(const std::string& isa) {
  static const AttentionPacking avx2 = RL_ATTENTION_PACKING(rl_avx2);
  static const AttentionPacking avx512 = RL_ATTENTION_PACKING(rl_avx512);
  static const AttentionPacking avx512_bf16 = RL_ATTENTION_PACKING(rl_avx512_bf16);
  if (isa == "avx2") return avx2;
  if (isa == "avx512") return avx512;
  return avx512_bf16;
}
}  // namespace

// One run of queries of one sequence: queries t0..t0+nq-1 of q row b; the
// query at position p reads the keys at slots s0 + 0..p of kv row r (the
// sequence's position 0 is slot s0). A padded batch is one run per row
// (t0 = 0, nq = Tq, r = kv_rows[b], s0 = 0); a packed row is one run per sequence.
struct AttentionRun {
  int64_t b, t0, nq, r, s0;
};

std::vector<AttentionRun> attention_runs(const c10::optional<at::Tensor>& runs_opt,
                                         const at::Tensor& kv_rows, int64_t B, int64_t Tq,
                                         int64_t S, int64_t Tk) {
  std::vector<AttentionRun> runs;
  if (!runs_opt.has_value() || !runs_opt->defined() || runs_opt->numel() == 0) {
    TORCH_CHECK(kv_rows.scalar_type() == at::kLong && kv_rows.numel() == B,
                "kv_rows must be int64 with one entry per q row");
    const at::Tensor rows = kv_rows.contiguous();
    const int64_t* rp = rows.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(rp[b] >= 0 && rp[b] < S, "kv row ", rp[b], " outside [0, ", S, ")");
      if (Tq > 0) runs.push_back({b, 0, Tq, rp[b], 0});
    }
    return runs;
  }
  const at::Tensor t = runs_opt->contiguous();
  TORCH_CHECK(t.dim() == 2 && t.size(1) == 5 && t.scalar_type() == at::kLong,
              "runs must be an int64 (n, 5) tensor of (q row, first column, count, kv row, "
              "first key slot)");
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.size(0); ++i) {
    const AttentionRun run{p[5 * i], p[5 * i + 1], p[5 * i + 2], p[5 * i + 3], p[5 * i + 4]};
    TORCH_CHECK(run.b >= 0 && run.b < B && run.t0 >= 0 && run.nq >= 1 && run.t0 + run.nq <= Tq,
                "run ", i, ": queries [", run.t0, ", ", run.t0 + run.nq, ") of q row ", run.b,
                " outside q (", B, " rows of ", Tq, ")");
    TORCH_CHECK(run.r >= 0 && run.r < S && run.s0 >= 0 && run.s0 <= Tk, "run ", i, ": kv row ",
                run.r, " slot ", run.s0, " outside k (", S, " rows of ", Tk, ")");
    runs.push_back(run);
  }
  return runs;
}

// Causal GQA attention over runs of queries (see AttentionRun). First the keys
// each run reads (positions 0..its largest p) are packed, per (run, kv head),
// into fp32 16-key blocks [D][16] aligned at the sequence's position 0 (bf16
// values are widened there too; data movement only). Then a task is (run, a
// pair of its query blocks, kv head): blocks i and nb-1-i share a task so that
// threads get about equal work in a causal prefill, and threads claim tasks
// dynamically. Blocks only group rows; each row's arithmetic is its own, so
// a query gets the same bits in a padded row, a packed row or a decode step.
// q (B, Hq, Tq, D) fp32 or bf16 (widened per block, exactly), k and v (S, Hkv,
// Tk, D) both fp32 or both bf16; all contiguous. Output fp32; queries with
// p < 0 and queries outside every run are 0.
// Paged keys (block_table given): k, v are (blocks, Hkv, bs, D) views with rows of D
// contiguous (stride(2) == D, stride(3) == 1; vLLM's CPU cache halves), bs a multiple
// of 16; q row b's position j is row j % bs of block block_table[b, j / bs]. One run
// per q row. The keys are packed into the same 16-key blocks as from an aligned row
// (16 divides bs, so no 16-key block spans two cache blocks), and the values copied
// (or widened) to one row of positions: the arithmetic is the aligned path's.
struct PagedKeys {
  const int64_t* table = nullptr;
  int64_t width = 0, bs = 0, stride_block = 0, stride_head = 0, v_shift = 0;
};

PagedKeys paged_keys(const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                     int64_t B) {
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 4 && t->stride(3) == 1 && t->stride(2) == t->size(3),
                "paged k, v must be (blocks, Hkv, block, D) with contiguous rows of D");
  }
  TORCH_CHECK(k.strides() == v.strides(), "paged k and v must share their strides");
  TORCH_CHECK(k.size(2) % 16 == 0, "the KV block size must be a multiple of 16, got ", k.size(2));
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == B &&
                  table.is_contiguous(),
              "block_table must be a contiguous int64 (B, blocks) tensor");
  const int64_t elem = k.element_size();
  const int64_t shift = ((const char*)v.data_ptr() - (const char*)k.data_ptr()) / elem;
  return {table.data_ptr<int64_t>(), table.size(1), k.size(2), k.stride(0), k.stride(1), shift};
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& q_positions, const at::Tensor& kv_rows, double scale,
                     const std::string& isa, const c10::optional<at::Tensor>& runs_opt,
                     const c10::optional<at::Tensor>& table_opt) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q must be a contiguous 4-D float32 or bfloat16 tensor");
  const bool paged = table_opt.has_value() && table_opt->defined();
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 4 && (paged || t->is_contiguous()) &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                "k, v must be contiguous 4-D float32 or bfloat16 tensors");
  }
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must have the same dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have the same shape");
  TORCH_CHECK(q_positions.scalar_type() == at::kLong, "q_positions must be int64");
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t S = k.size(0), Hkv = k.size(1), Tk = k.size(2);
  TORCH_CHECK(k.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "k/v heads or head dim mismatch");
  TORCH_CHECK(D >= 1 && D <= 256, "head dim must be in [1, 256], got ", D);
  TORCH_CHECK(Hq / Hkv <= 256, "at most 256 query heads per kv head, got ", Hq / Hkv);
  TORCH_CHECK(q_positions.dim() == 2 && q_positions.size(0) == B && q_positions.size(1) == Tq,
              "q_positions must be (B, Tq)");
  PagedKeys pk;
  if (paged) {
    TORCH_CHECK(!runs_opt.has_value() || !runs_opt->defined(), "block_table takes no runs");
    pk = paged_keys(k, v, *table_opt, B);
  }
  const std::vector<AttentionRun> runs =
      paged ? attention_runs(c10::nullopt, at::arange(B, at::kLong), B, Tq, B, Tk)
            : attention_runs(runs_opt, kv_rows, B, Tq, S, Tk);
  const int64_t NR = (int64_t)runs.size();
  const at::Tensor pos = q_positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  int64_t max_pos = -1, covered = 0, max_nq = 1;
  std::vector<int64_t> nblk(NR), kt_off(NR + 1, 0);  // packed 16-key blocks of run i
  for (int64_t i = 0; i < NR; ++i) {
    const AttentionRun& run = runs[i];
    int64_t mb = -1;
    for (int64_t t = 0; t < run.nq; ++t) mb = std::max(mb, pp[run.b * Tq + run.t0 + t]);
    if (paged) {
      const int64_t need = (mb + 1 + pk.bs - 1) / pk.bs;
      TORCH_CHECK(need <= pk.width, "a query at position ", mb, " of q row ", run.b, " needs ",
                  need, " KV blocks, but block_table holds ", pk.width);
      for (int64_t c = 0; c < need; ++c) {
        const int64_t blk = pk.table[run.b * pk.width + c];
        TORCH_CHECK(blk >= 0 && blk < S, "block_table[", run.b, ", ", c, "] = ", blk,
                    " outside the cache's ", S, " blocks");
      }
    } else {
      TORCH_CHECK(run.s0 + mb < Tk, "a query at position ", mb, " needs ", mb + 1,
                  " keys from slot ", run.s0, ", but k holds ", Tk);
    }
    max_pos = std::max(max_pos, mb);
    covered += run.nq;
    max_nq = std::max(max_nq, run.nq);
    nblk[i] = (mb + 1 + 15) / 16;
    kt_off[i + 1] = kt_off[i] + Hkv * nblk[i] * D * 16;
  }
  const Kernels& kern = kernels_for(isa);
  const AttentionPacking& packing = attention_packing_for(isa);
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  if (max_pos < 0) return at::zeros(q.sizes(), f32);
  // every row of a run is written by its task; rows outside every run stay 0
  at::Tensor out = covered == B * Tq ? at::empty(q.sizes(), f32) : at::zeros(q.sizes(), f32);
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  const bool own_values = bf16 || paged;  // values copied (widened) to one row of positions
  const int G = (int)(Hq / Hkv);
  const int64_t QB = std::max<int64_t>(1, std::min<int64_t>(16, 256 / G));  // queries per block
  const int64_t L = (max_pos + 1 + 15) / 16 * 16;
  // (run, pair of query blocks) entries; a task is an entry and a kv head
  std::vector<std::pair<int64_t, int64_t>> entries;
  bool shared_pack = false;
  for (int64_t i = 0; i < NR; ++i) {
    const int64_t nb = (runs[i].nq + QB - 1) / QB;
    shared_pack |= nb > 1;
    for (int64_t j = 0; j < (nb + 1) / 2; ++j) entries.emplace_back(i, j);
  }
  // Every run one query block (decode, short sequences): its task packs the
  // keys (and widens bf16 values and queries) into its thread's scratch, where
  // they stay in cache. Otherwise that is done once into buffers all tasks share.
  const int64_t rows_max = std::min(QB, max_nq) * G;  // rows of one block (G for a decode)
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const int64_t q_own = q_bf16 && !shared_pack ? rows_max * D : 0;  // the queries, widened
  const int64_t per_thread =
      rows_max * (D + L) + q_own + (shared_pack ? 0 : L * D * (own_values ? 2 : 1));
  at::Tensor scratch = at::empty({at::get_num_threads(), per_thread}, f32);
  at::Tensor packed = at::empty({shared_pack ? kt_off[NR] : 0}, f32);
  at::Tensor widened = at::empty({shared_pack && own_values ? kt_off[NR] : 0}, f32);
  at::Tensor q_wide = at::empty({shared_pack && q_bf16 ? q.numel() : 0}, f32);
  float* qwp = q_wide.data_ptr<float>();
  const void* qp = q.data_ptr();
  const void* kp = k.data_ptr();
  const void* vp = v.data_ptr();
  float* ktp = packed.data_ptr<float>();
  float* vwp = widened.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Keys 0..n-1 from element offset koff into kt; bf16 values 0..n-1 into vw.
  auto prepare = [&](int64_t koff, int64_t n, float* kt, float* vw) {
    if (bf16) {
      packing.pack_bf16(static_cast<const uint16_t*>(kp) + koff, n, D, kt);
      packing.widen_bf16(static_cast<const uint16_t*>(vp) + koff, n * D, vw);
    } else {
      packing.pack_f32(static_cast<const float*>(kp) + koff, n, D, kt);
    }
  };
  auto key_offset = [&](const AttentionRun& run, int64_t h) {
    return ((run.r * Hkv + h) * Tk + run.s0) * D;
  };
  // Paged: keys (values) 0..n-1 of q row b, kv head h, block by block.
  auto prepare_paged = [&](int64_t b, int64_t h, int64_t n, float* kt, float* vw) {
    const int64_t* table = pk.table + b * pk.width;
    for (int64_t j0 = 0; j0 < n; j0 += pk.bs) {
      const int64_t cnt = std::min(pk.bs, n - j0);
      const int64_t off = table[j0 / pk.bs] * pk.stride_block + h * pk.stride_head;
      float* ktb = kt + (j0 / 16) * D * 16;
      if (bf16) {
        packing.pack_bf16(static_cast<const uint16_t*>(kp) + off, cnt, D, ktb);
        packing.widen_bf16(static_cast<const uint16_t*>(kp) + off + pk.v_shift, cnt * D,
                           vw + j0 * D);
      } else {
        packing.pack_f32(static_cast<const float*>(kp) + off, cnt, D, ktb);
        std::memcpy(vw + j0 * D, static_cast<const float*>(kp) + off + pk.v_shift,
                    cnt * D * sizeof(float));
      }
    }
  };
  auto prepare_run = [&](const AttentionRun& run, int64_t h, int64_t nb, float* kt, float* vw) {
    if (paged) return prepare_paged(run.b, h, nb * 16, kt, vw);
    prepare(key_offset(run, h), std::min(nb * 16, Tk - run.s0), kt, vw);
  };
  if (shared_pack) {
    at::parallel_for(0, NR * Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / Hkv, h = task % Hkv;
        const AttentionRun& run = runs[i];
        const int64_t off = kt_off[i] + h * nblk[i] * D * 16;
        prepare_run(run, h, nblk[i], ktp + off, vwp + off);
      }
    });
    if (q_bf16) {  // the G heads of each kv head, all positions
      at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t qh = (task / Hkv * Hq + task % Hkv * G) * Tq * D;
          packing.widen_bf16(static_cast<const uint16_t*>(qp) + qh, G * Tq * D, qwp + qh);
        }
      });
    }
  }
  parallel_tasks((int64_t)entries.size() * Hkv, [&](int64_t task) {
    float* scr = scratch.data_ptr<float>() + at::get_thread_num() * per_thread;
    const int64_t ri = entries[task / Hkv].first, i = entries[task / Hkv].second;
    const int64_t h = task % Hkv;
    const AttentionRun& run = runs[ri];
    const int64_t koff = paged ? 0 : key_offset(run, h);
    const int64_t off = kt_off[ri] + h * nblk[ri] * D * 16;
    const float* kt = ktp + off;
    const float* vf = own_values ? vwp + off : static_cast<const float*>(vp) + koff;
    // The G heads of this kv head as fp32 rows [g][..][D]; column t at qf + t * D.
    const int64_t qh = (run.b * Hq + h * G) * Tq * D;
    const float* qf = (q_bf16 ? qwp + qh : static_cast<const float*>(qp) + qh) + run.t0 * D;
    int64_t ldq = Tq * D;
    if (!shared_pack) {
      float* own_k = scr + rows_max * (D + L) + q_own;
      float* own_v = own_k + L * D;
      prepare_run(run, h, nblk[ri], own_k, own_v);
      kt = own_k;
      if (own_values) vf = own_v;
      if (q_bf16) {  // one block: nq <= QB, so G * nq * D fits in q_own
        float* own_q = scr + rows_max * (D + L);
        for (int g = 0; g < G; ++g)
          packing.widen_bf16(static_cast<const uint16_t*>(qp) + qh + g * Tq * D + run.t0 * D,
                             run.nq * D, own_q + g * run.nq * D);
        qf = own_q;
        ldq = run.nq * D;
      }
    }
    const int64_t nb = (run.nq + QB - 1) / QB;
    const int64_t blocks[2] = {i, nb - 1 - i};
    for (int u = 0; u < (blocks[0] == blocks[1] ? 1 : 2); ++u) {
      const int64_t t0 = blocks[u] * QB, nq = std::min(QB, run.nq - t0);  // within the run
      const int64_t col = run.t0 + t0;
      const int64_t qoff = ((run.b * Hq + h * G) * Tq + col) * D;
      for (int64_t t = 0; t < nq; ++t)  // padding queries: exact zeros
        if (pp[run.b * Tq + col + t] < 0)
          for (int g = 0; g < G; ++g) std::fill_n(op + qoff + g * Tq * D + t * D, D, 0.0f);
      kern.attention_block(qf + t0 * D, ldq, G, (int)nq, pp + run.b * Tq + col, kt, vf, Tk, D,
                           (float)scale, op + qoff, Tq * D, scr);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa_supported", &isa_supported, "whether this CPU runs the named instruction-set path");
  m.def("gemm", &gemm, "fixed-order x @ w^T (+ bias) -> float32, or bfloat16 with out_bf16",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("isa"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_bf16") = false);
  m.def("gemm_pack", &gemm_pack, "a weight (N, K) packed once into the panels gemm_packed reads",
        pybind11::arg("weight"), pybind11::arg("isa"), pybind11::arg("out") = pybind11::none());
  m.def("gemm_packed", &gemm_packed, "gemm on a weight packed by gemm_pack: the same bits",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("isa"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_bf16") = false);
  m.def("silu", &silu, "fixed-order SiLU");
  m.def("moe_experts", &moe_experts,
        "mixture-of-experts experts: grouped fixed-order GEMMs, SiLU gate, HF-order combine");
  m.def("attention", &attention, "fixed-order causal GQA attention forward",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("q_positions"),
        pybind11::arg("kv_rows"), pybind11::arg("scale"), pybind11::arg("isa"),
        pybind11::arg("runs") = pybind11::none(), pybind11::arg("block_table") = pybind11::none());
}
