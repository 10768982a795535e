// int4 weight x int8 activation product for CPUs with AVX-512 VNNI (e.g. AMD Zen 4/5, Intel since Ice Lake), on
// records of the same size as int4_mm.cpp's and int4_mm_avx2.cpp's, with the value bytes in another order
// (causaldraft/models/int4_kernel.py has the layouts, docs/int4-kernel.md the arithmetic). The AVX2 build's
// arithmetic, bit for bit (tested): each row's activations are rounded to int8 per group of 32 inputs
// (d = amax / 127, xi = round(x / d), S = sum of xi), D = sum of xi q over the group is an exact integer, and per
// channel total += float(D - 8 S) * (scale * d) + zero * (d * S) in fp32, group by group in input order, rounded
// once to bf16.
//
// How (stop 32; the record order and the vector rounding since stop 46): a record's 256 value bytes are 4 pieces
// of 64; piece p's low nibbles are 16 lanes of 4 bytes, lane n = channel n's values at inputs 8p .. 8p + 3, and
// its high nibbles the same for inputs 8p + 4 .. 8p + 7 (one mask, or a shift and a mask, per 16 channels x 4
// inputs). One vpdpbusd per row then adds each channel's 4 products with the row's 4 values xi (broadcast) to its
// int32 D - 8 S (started at -8 S): 8 instructions per row and record, against 16 bf16 dot products and 16
// broadcasts in the AVX-512 bf16 build and 48 in the AVX2 build. A block's rows keep their fp32 totals in
// registers across its groups, 8 rows at a time (a block's records, at most a few KB, are read again from cache
// for rows 9 and on). A row's instructions do not depend on the call's other rows or threads: row-invariant
// (tested).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // output channels per block (one zmm of lanes)
constexpr int64_t kGroup = 32;  // inputs per quantization group
constexpr int64_t kChunks = kGroup / 4;  // 32-byte chunks of a record, 4 inputs each
constexpr int64_t kNibbles = kBlock * kGroup / 2;  // bytes of int4 values per (block, group)
constexpr int64_t kBytes = kNibbles + 4 * kBlock;  // + 16 bf16 scales + 16 bf16 zeros
constexpr int64_t kAhead = 8;  // records prefetched ahead of the one being read
constexpr int kRowsAtOnce = 8;  // rows whose totals stay in registers over a block's groups
constexpr int kLargest = 127;  // quantized activations lie in [-127, 127]

// Rows' activations rounded per group as in the AVX2 build (the same bits): values [rows, in] in input
// order; per (row, group) the step d, the sum S and d * S.
struct QuantizedRows {
  std::vector<int8_t> values;
  std::vector<float> step;
  std::vector<int32_t> sum;
  std::vector<float> step_sum;
};

inline __m512 bf16_to_fp32(const uint8_t* bytes) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

// The AVX2 build's scalar rounding, 32 values at a time: the same bits (a maximum and integer sums are exact;
// fp32 products are rounded to the nearest integer, ties to even, by the conversion as by nearbyint).
void quantize_rows(const c10::BFloat16* x, int64_t rows, int64_t in_features, QuantizedRows& q) {
  const int64_t groups = in_features / kGroup;
  q.values.resize(rows * in_features);
  q.step.resize(rows * groups);
  q.sum.resize(rows * groups);
  q.step_sum.resize(rows * groups);
  const __m512i largest = _mm512_set1_epi32(kLargest), smallest = _mm512_set1_epi32(-kLargest);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* in = reinterpret_cast<const uint8_t*>(x + m * in_features + g * kGroup);
      const __m512 low = bf16_to_fp32(in), high = bf16_to_fp32(in + 32);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? kLargest / amax : 0.0f);
      const __m512i low_values =
          _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(low, inverse)), smallest), largest);
      const __m512i high_values =
          _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(high, inverse)), smallest), largest);
      int8_t* out = q.values.data() + m * in_features + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(low_values));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(high_values));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(low_values, high_values));
      const float step = amax / kLargest;
      q.step[m * groups + g] = step;
      q.sum[m * groups + g] = sum;
      q.step_sum[m * groups + g] = step * static_cast<float>(sum);
    }
  }
}

// The 8 chunks of a record as vpdpbusd operands and B tile rows (unsigned bytes 0..15, lane n = channel n's values
// at inputs 4c .. 4c + 3). This build's records hold them as 4 pieces of 64 bytes (``pack_blocks`` with
// ``quads``): piece p's low nibbles are chunk 2p, its high nibbles chunk 2p + 1.
inline void unpack(const uint8_t* record, __m512i* quads) {
  const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int p = 0; p < kChunks / 2; ++p) {
    const __m512i bytes = _mm512_loadu_si512(record + 64 * p);
    quads[2 * p] = _mm512_and_si512(bytes, low);
    quads[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
  }
}

// R rows' totals += one record's terms. ``xs[r]``: row r's 32 rounded values of the group.
template <int R>
inline void rows_group(const __m512i* quads, const int8_t* const* xs, const float* steps, const int32_t* sums,
                       const float* step_sums, __m512 scale, __m512 zero, __m512* totals) {
  __m512i dots[R];  // D - 8 S: the sums start at -8 S (exact integers either way)
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) dots[r] = _mm512_set1_epi32(-8 * sums[r]);
#pragma GCC unroll 8
  for (int c = 0; c < kChunks; ++c) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t x0123;
      std::memcpy(&x0123, xs[r] + 4 * c, 4);
      dots[r] = _mm512_dpbusd_epi32(dots[r], quads[c], _mm512_set1_epi32(x0123));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(scale, _mm512_set1_ps(steps[r])),
                                         totals[r]);
    totals[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(step_sums[r]), value);
  }
}

// Rows m .. m + R - 1 of block b, over all its groups.
template <int R>
inline void rows_block(const uint8_t* weights, int64_t b, int64_t groups, int64_t last, int64_t m,
                       int64_t in_features, const QuantizedRows& q, float* out) {
  __m512 totals[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) totals[r] = _mm512_setzero_ps();
  __m512i quads[kChunks];
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t index = b * groups + g;
    const uint8_t* record = weights + index * kBytes;
    const uint8_t* ahead = weights + std::min(index + kAhead, last) * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    }
    unpack(record, quads);
    const int8_t* xs[R];
    float steps[R], step_sums[R];
    int32_t sums[R];
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m + r) * groups + g;
      xs[r] = q.values.data() + (m + r) * in_features + g * kGroup;
      steps[r] = q.step[at];
      sums[r] = q.sum[at];
      step_sums[r] = q.step_sum[at];
    }
    rows_group<R>(quads, xs, steps, sums, step_sums, bf16_to_fp32(record + kNibbles),
                  bf16_to_fp32(record + kNibbles + 2 * kBlock), totals);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlock, totals[r]);
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int4_mm: x must be [m, k] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(), "int4_mm: bad packed");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(groups * kGroup == in_features && packed.size(2) == kBytes, "int4_mm: packed does not fit x");
  at::Tensor out = at::empty({rows, blocks * kBlock}, x.options());
  if (rows == 0) return out;
  QuantizedRows q;
  quantize_rows(x.data_ptr<at::BFloat16>(), rows, in_features, q);
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  auto* result = out.data_ptr<at::BFloat16>();
  const int64_t out_features = blocks * kBlock;
  const int64_t last = blocks * groups - 1;  // the last record (prefetches stay within the weights)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float totals[kRowsAtOnce * kBlock];
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m = 0; m < rows; m += kRowsAtOnce) {
        const int count = static_cast<int>(std::min<int64_t>(kRowsAtOnce, rows - m));
        if (count == 1) rows_block<1>(weights, b, groups, last, m, in_features, q, totals);
        if (count == 2) rows_block<2>(weights, b, groups, last, m, in_features, q, totals);
        if (count == 3) rows_block<3>(weights, b, groups, last, m, in_features, q, totals);
        if (count == 4) rows_block<4>(weights, b, groups, last, m, in_features, q, totals);
        if (count == 5) rows_block<5>(weights, b, groups, last, m, in_features, q, totals);
        if (count == 6) rows_block<6>(weights, b, groups, last, m, in_features, q, totals);
        if (count == 7) rows_block<7>(weights, b, groups, last, m, in_features, q, totals);
        if (count == 8) rows_block<8>(weights, b, groups, last, m, in_features, q, totals);
        for (int r = 0; r < count; ++r) {
          for (int64_t n = 0; n < kBlock; ++n) {
            result[(m + r) * out_features + b * kBlock + n] = c10::BFloat16(totals[r * kBlock + n]);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(causaldraft, m) {
  m.def("int4_mm(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(causaldraft, CPU, m) {
  m.impl("int4_mm", &int4_mm);
}
