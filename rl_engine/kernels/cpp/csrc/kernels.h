// Entry points of the per-ISA kernel files (isa_*.cpp), one namespace each.
#pragma once
#include <cstdint>

#define RL_DECLARE_KERNELS(ns)                                                                 \
  namespace ns {                                                                               \
  int64_t gemm_scratch_bytes(int64_t kb);                                                             \
  void gemm_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,            \
                int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t kb, void* scratch,       \
                void* out, int64_t ldo, int out_bf16, const void* bias);                       \
  void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,     \
                 int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t kb, void* scratch,      \
                 void* out, int64_t ldo, int out_bf16, const void* bias);                      \
  void gemm_pack_f32(const float* w, int64_t ldw, int64_t N, int64_t K, int64_t kb, float* out); \
  void gemm_pack_bf16(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, int64_t kb,        \
                      uint16_t* out);                                                          \
  void gemm_packed_f32(const float* x, int64_t ldx, const float* packed, int64_t nkb, float* y, \
                       int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t kb, void* out,    \
                       int64_t ldo, int out_bf16, const void* bias);                           \
  void gemm_packed_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t nkb,   \
                        float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t kb,    \
                        void* out, int64_t ldo, int out_bf16, const void* bias);               \
  void silu_f32(const float* x, float* y, int64_t n);                                          \
  void silu_bf16(const uint16_t* x, uint16_t* y, int64_t n);                                   \
  void attention_block(const float* q, int64_t ldq_head, int G, int nq, const int64_t* pos,   \
                       const float* k, const float* v, int64_t Tk, int64_t D, float scale,     \
                       float* out, int64_t ldo_head, float* scratch);                          \
  }

RL_DECLARE_KERNELS(rl_avx2)
RL_DECLARE_KERNELS(rl_avx512)
RL_DECLARE_KERNELS(rl_avx512_bf16)
