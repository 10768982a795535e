// int4 weight x bf16 activation product: exact bf16 products of the unpacked weights, fp32 sums.
//
// See causaldraft/models/int4_kernel.py for the layout and the arithmetic (docs/int4-kernel.md).
// A block of 16 channels is computed 4 rows at a time: each record is unpacked once per 4 rows and the rows'
// fp32 totals stay in registers across the block's groups (stop 33; until then each record was unpacked once
// for all rows and every row's totals went through memory after every group: the same operations in the same
// order, so the same bits, but a 4-row product took ~2.9 ms of a pass against ~2.1 now).
// Every output element is computed by the same instruction sequence whatever the row count and
// the thread count, so a row's result does not depend on the other rows of the call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // output channels per block (one zmm of fp32 lanes)
constexpr int64_t kGroup = 32;  // inputs per quantization group
constexpr int64_t kPairs = kGroup / 2;  // bf16 pairs per group (one dot-product step each)
constexpr int64_t kNibbles = kBlock * kGroup / 2;  // bytes of int4 values per (block, group)
constexpr int64_t kBytes = kNibbles + 4 * kBlock;  // + 16 bf16 scales + 16 bf16 zeros
constexpr int64_t kAhead = 8;  // records prefetched ahead of the one being read

__m512i weight_table() {
  alignas(64) uint16_t table[32];
  for (int q = 0; q < 32; ++q) {
    float value = static_cast<float>((q & 15) - 8);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    table[q] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(table);
}

// The 16 dot-product operands of one (block, group): words 2n+t of operand p hold the weight of
// channel n at input 2p+t, as bf16 (q - 8).
inline void unpack(const uint8_t* bytes, __m512i table, __m512i* operands) {
  const __m512i low_mask = _mm512_set1_epi16(0x0F);
  for (int chunk = 0; chunk < kPairs / 2; ++chunk) {
    __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * chunk)));
    operands[2 * chunk] = _mm512_permutexvar_epi16(_mm512_and_si512(words, low_mask), table);
    operands[2 * chunk + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
  }
}

inline __m512 bf16_to_fp32(const uint8_t* bytes) {
  __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

// R rows' dot products with one unpacked (block, group). Each row has two chains (even and odd
// pairs), summed at the end: the same arithmetic for a row whatever R is.
template <int R>
inline void group_dots(const uint32_t* const* rows, const __m512i* operands, __m512* out) {
  __m512 even[R], odd[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int p = 0; p < kPairs; p += 2) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(rows[r][p]), (__m512bh)operands[p]);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(rows[r][p + 1]), (__m512bh)operands[p + 1]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r] = _mm512_add_ps(even[r], odd[r]);
}

// Rows m .. m + R - 1 of block b over all its groups, fp32 totals in registers: per group
// total = fma(dot, scale, total), then fma(zero, sum, total), as before.
template <int R>
inline void rows_block(const uint8_t* weights, int64_t b, int64_t groups, int64_t last, int64_t m,
                       const uint32_t* pairs, int64_t in_features, const float* sums, __m512i table, float* out) {
  __m512 totals[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) totals[r] = _mm512_setzero_ps();
  __m512i operands[kPairs];
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t index = b * groups + g;
    const uint8_t* record = weights + index * kBytes;
    const uint8_t* ahead = weights + std::min(index + kAhead, last) * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    }
    unpack(record, table, operands);
    const __m512 scale = bf16_to_fp32(record + kNibbles);
    const __m512 zero = bf16_to_fp32(record + kNibbles + 2 * kBlock);
    const uint32_t* rows[R];
    __m512 dots[R];
    for (int r = 0; r < R; ++r) rows[r] = pairs + ((m + r) * in_features + g * kGroup) / 2;
    group_dots<R>(rows, operands, dots);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 value = _mm512_fmadd_ps(dots[r], scale, totals[r]);
      totals[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(sums[(m + r) * groups + g]), value);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlock, totals[r]);
}

// R rows of block b over all its groups, each record unpacked chunk by chunk as its operands are used
// (two at a time: chunk c's low nibbles are pair 2c, the even chain's; its high nibbles pair 2c + 1, the odd
// chain's), so 8 rows' chains fit the registers: the same operations in the same order per row as rows_block.
template <int R>
inline void rows_block_stream(const uint8_t* weights, int64_t b, int64_t groups, int64_t last, int64_t m,
                              const uint32_t* pairs, int64_t in_features, const float* sums, __m512i table,
                              float* out) {
  __m512 totals[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) totals[r] = _mm512_setzero_ps();
  const __m512i low_mask = _mm512_set1_epi16(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t index = b * groups + g;
    const uint8_t* record = weights + index * kBytes;
    const uint8_t* ahead = weights + std::min(index + kAhead, last) * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    }
    const uint32_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = pairs + ((m + r) * in_features + g * kGroup) / 2;
    __m512 even[R], odd[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int chunk = 0; chunk < kPairs / 2; ++chunk) {
      const __m512i words =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 32 * chunk)));
      const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(words, low_mask), table);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(rows[r][2 * chunk]), w0);
        odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(rows[r][2 * chunk + 1]), w1);
      }
    }
    const __m512 scale = bf16_to_fp32(record + kNibbles);
    const __m512 zero = bf16_to_fp32(record + kNibbles + 2 * kBlock);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 value = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), scale, totals[r]);
      totals[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(sums[(m + r) * groups + g]), value);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlock, totals[r]);
}

// Sum of each row's inputs per group (fp32), for the zero-point term: [rows, groups].
std::vector<float> group_sums(const uint16_t* x, int64_t rows, int64_t in_features) {
  const int64_t groups = in_features / kGroup;
  std::vector<float> sums(rows * groups);
  const __m512i ones = _mm512_set1_epi16(0x3F80);  // bf16 1.0
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      __m512i values = _mm512_loadu_si512(x + m * in_features + g * kGroup);
      __m512 partial = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)values, (__m512bh)ones);
      sums[m * groups + g] = _mm512_reduce_add_ps(partial);
    }
  }
  return sums;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int4_mm: x must be [m, k] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(), "int4_mm: bad packed");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(groups * kGroup == in_features && packed.size(2) == kBytes, "int4_mm: packed does not fit x");
  at::Tensor out = at::empty({rows, blocks * kBlock}, x.options());
  if (rows == 0) return out;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* pairs = reinterpret_cast<const uint32_t*>(xs);  // row m, pair i at m * k / 2 + i
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  auto* result = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const std::vector<float> sums = group_sums(xs, rows, in_features);
  const int64_t out_features = blocks * kBlock;
  const int64_t last = blocks * groups - 1;  // the last record (prefetches stay within the weights)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const __m512i table = weight_table();
    alignas(64) float totals[8 * kBlock];
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m = 0; m < rows; m += 4) {
        if (ROWS8 && rows - m >= 8) {
          rows_block_stream<8>(weights, b, groups, last, m, pairs, in_features, sums.data(), table, totals);
          for (int r = 0; r < 8; ++r) {
            __m256i bf = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&totals[r * kBlock]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(result + (m + r) * out_features + b * kBlock), bf);
          }
          m += 4;
          continue;
        }
        const int count = static_cast<int>(std::min<int64_t>(4, rows - m));
        if (count == 1) rows_block<1>(weights, b, groups, last, m, pairs, in_features, sums.data(), table, totals);
        if (count == 2) rows_block<2>(weights, b, groups, last, m, pairs, in_features, sums.data(), table, totals);
        if (count == 3) rows_block<3>(weights, b, groups, last, m, pairs, in_features, sums.data(), table, totals);
        if (count == 4) rows_block<4>(weights, b, groups, last, m, pairs, in_features, sums.data(), table, totals);
        for (int r = 0; r < count; ++r) {
          __m256i bf = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&totals[r * kBlock]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(result + (m + r) * out_features + b * kBlock), bf);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(s57proto, m) {
  m.def("int4_mm(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(s57proto, CPU, m) {
  m.impl("int4_mm", &int4_mm);
}
