// bf16 weights x bf16 activations (AVX-512 bf16), for bf16 models' linears (since stop 33): built beside the
// AVX-512 bf16 and the VNNI int4 builds (``int4_kernel.BF16_SOURCE``; until stop 35 it was part of int4_mm.cpp,
// so only the AVX-512 bf16 build had it). The AVX2 build has its own bf16_mm (fp32 multiply-adds).
//
// Every output element is computed by the same instruction sequence whatever the row count and the thread count,
// so a row's result does not depend on the other rows of the call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kBlock = 16;  // output channels per block (one zmm of fp32 lanes)

// Records as the AVX2 build's bf16_mm reads them (``int4_kernel.pack_channels``): [out / 16, in, 16], each
// input's 16 channels. One word permutation (vpermw) turns inputs 2p and 2p + 1 of a block (64 bytes) into 16
// lanes of bf16 pairs (channel n's weights at 2p, 2p + 1), the operand of one vdpbf16ps per row: per row, two
// fp32 chains (even and odd pairs) in registers over the whole input, summed and rounded once to bf16. Rows go
// 8 at a time (each permuted operand serves 8 rows; a block's weights, at most a few tens of KB, are read again
// from cache for rows 9 and on). A row's instructions do not depend on the call's other rows or threads.
constexpr int64_t kPairRows = 8;  // rows sharing each permuted operand
constexpr int64_t kPairAhead = 1024;  // bytes prefetched ahead in a block's weights

inline __m512i pair_order() {
  alignas(64) uint16_t index[32];
  for (int n = 0; n < 16; ++n) {
    index[2 * n] = static_cast<uint16_t>(n);
    index[2 * n + 1] = static_cast<uint16_t>(16 + n);
  }
  return _mm512_load_si512(index);
}

// Rows m .. m + R - 1 times one block: ``block`` [in, 16] bf16, ``pairs`` the rows' inputs as bf16 pairs.
template <int R>
inline void pair_rows(const uint16_t* block, int64_t in_pairs, const uint32_t* pairs, int64_t m, __m512i order,
                      uint16_t* out, int64_t out_features) {
  __m512 even[R], odd[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const uint32_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = pairs + (m + r) * in_pairs;
  const char* bytes = reinterpret_cast<const char*>(block);
  int64_t p = 0;
  for (; p + 2 <= in_pairs; p += 2) {
    _mm_prefetch(bytes + p * 64 + kPairAhead, _MM_HINT_T0);
    _mm_prefetch(bytes + p * 64 + 64 + kPairAhead, _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(block + p * 2 * kBlock));
    const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(block + (p + 1) * 2 * kBlock));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(rows[r][p]), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(rows[r][p + 1]), w1);
    }
  }
  if (p < in_pairs) {  // an odd number of pairs: the last one joins the even chain
    const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(block + p * 2 * kBlock));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(rows[r][p]), w0);
  }
  for (int r = 0; r < R; ++r) {
    const __m256i bf = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(even[r], odd[r]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m + r) * out_features), bf);
  }
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "bf16_mm: x must be [m, k] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kBlock, "bf16_mm: bad packed");
  TORCH_CHECK(packed.size(1) == x.size(1) && x.size(1) % 2 == 0, "bf16_mm: packed does not fit x");
  const int64_t rows = x.size(0), in_features = x.size(1), blocks = packed.size(0);
  const int64_t out_features = blocks * kBlock, in_pairs = in_features / 2;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const auto* pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const auto* weights = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* result = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const __m512i order = pair_order();
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* block = weights + b * in_features * kBlock;
      uint16_t* out_block = result + b * kBlock;
      int64_t m = 0;
      for (; m + kPairRows <= rows; m += kPairRows) pair_rows<8>(block, in_pairs, pairs, m, order, out_block, out_features);
      for (; m + 4 <= rows; m += 4) pair_rows<4>(block, in_pairs, pairs, m, order, out_block, out_features);
      for (; m + 2 <= rows; m += 2) pair_rows<2>(block, in_pairs, pairs, m, order, out_block, out_features);
      for (; m < rows; ++m) pair_rows<1>(block, in_pairs, pairs, m, order, out_block, out_features);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(causaldraft, m) { m.def("bf16_mm(Tensor x, Tensor packed) -> Tensor"); }

TORCH_LIBRARY_IMPL(causaldraft, CPU, m) { m.impl("bf16_mm", &bf16_mm); }
