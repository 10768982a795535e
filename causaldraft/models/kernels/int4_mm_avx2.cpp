// int4 weight x bf16 activation product for CPUs with AVX2 and FMA but no AVX-512 bf16 (e.g. AMD
// Zen 3), on the same records as int4_mm.cpp (causaldraft/models/int4_kernel.py has the layout,
// docs/int4-kernel.md the arithmetic). Integer dot products on 8-bit activations, as llama.cpp's
// Q4_1 x Q8_1 product does (stop 25; before, fp32 multiply-adds: ~3x the instructions per row).
//
// Each row's activations are quantized per group of 32 inputs (the weights' group): d = amax / 127,
// xi = round(x / d) in [-127, 127], S = sum of xi. A record's chunk c (32 bytes: byte 2n + p holds
// channel n's values at inputs 4c + p in its low nibble and 4c + 2 + p in its high nibble) masked to
// its low nibbles is 16 pairs of unsigned bytes, one pair per channel, and vpmaddubsw against the
// broadcast pair (xi[4c], xi[4c + 1]) gives each channel's q0 x0 + q1 x1 as an int16 (|.| <= 3810);
// likewise the high nibbles with (xi[4c + 2], xi[4c + 3]). Four chunks add up in int16 (<= 30480),
// the two halves of the group in int32: D = sum over the group of xi q, exact. Then T = D - 8 S
// (exact) and, per channel, total += float(T) * (scale * d) + zero * (d * S) in fp32, group by group
// in input order. Integer sums do not depend on their order, and the fp32 steps are the same
// instructions for a row whatever the call's other rows and threads: row-invariant (tested).
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

constexpr int64_t kBlock = 16;  // output channels per block (two ymm of fp32 lanes)
constexpr int64_t kGroup = 32;  // inputs per quantization group
constexpr int64_t kChunks = kGroup / 4;  // 32-byte chunks of a record, 4 inputs each
constexpr int64_t kNibbles = kBlock * kGroup / 2;  // bytes of int4 values per (block, group)
constexpr int64_t kBytes = kNibbles + 4 * kBlock;  // + 16 bf16 scales + 16 bf16 zeros
constexpr int64_t kAhead = 8;  // records prefetched ahead of the one being read
constexpr int64_t kLine = 64 / sizeof(float);  // floats per cache line
constexpr int kRowsAtOnce = 4;  // rows sharing a record's unpacked chunks (their sums stay in registers)
constexpr int kLargest = 127;  // quantized activations lie in [-127, 127]

inline __m256 bf16_to_fp32(const uint8_t* bytes) {
  __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}

// Slot p's weights (both halves) times R rows' activation at that slot, into the even or odd chains.
template <int R>
inline void slot_step(int p, __m256 w_lo, __m256 w_hi, const float* const* slots, int64_t offset, __m256* even_lo,
                      __m256* even_hi, __m256* odd_lo, __m256* odd_hi) {
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_broadcast_ss(slots[r] + offset);
    if (p % 2 == 0) {
      even_lo[r] = _mm256_fmadd_ps(w_lo, a, even_lo[r]);
      even_hi[r] = _mm256_fmadd_ps(w_hi, a, even_hi[r]);
    } else {
      odd_lo[r] = _mm256_fmadd_ps(w_lo, a, odd_lo[r]);
      odd_hi[r] = _mm256_fmadd_ps(w_hi, a, odd_hi[r]);
    }
  }
}

// Rows' activations quantized per group: values [rows, in] in input order; per (row, group) the
// step d, the sum S of the values and d * S (fp32), each computed once per row in a fixed order.
struct QuantizedRows {
  std::vector<int8_t> values;
  std::vector<int8_t> magnitudes;  // |values|, the unsigned operand of the int8 product's vpmaddubsw
  std::vector<float> step;
  std::vector<int32_t> sum;
  std::vector<float> step_sum;
};

void quantize_rows(const c10::BFloat16* x, int64_t rows, int64_t in_features, QuantizedRows& q) {
  const int64_t groups = in_features / kGroup;
  q.values.resize(rows * in_features);
  q.magnitudes.resize(rows * in_features);
  q.step.resize(rows * groups);
  q.sum.resize(rows * groups);
  q.step_sum.resize(rows * groups);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const c10::BFloat16* in = x + m * in_features + g * kGroup;
      float amax = 0.0f;
      for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(static_cast<float>(in[i])));
      const float inverse = amax > 0.0f ? kLargest / amax : 0.0f;
      int8_t* out = q.values.data() + m * in_features + g * kGroup;
      int8_t* magnitude = q.magnitudes.data() + m * in_features + g * kGroup;
      int32_t sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const int value = std::clamp(static_cast<int>(std::nearbyint(static_cast<float>(in[i]) * inverse)),
                                     -kLargest, kLargest);
        out[i] = static_cast<int8_t>(value);
        magnitude[i] = static_cast<int8_t>(value < 0 ? -value : value);
        sum += value;
      }
      const float step = amax / kLargest;
      q.step[m * groups + g] = step;
      q.sum[m * groups + g] = sum;
      q.step_sum[m * groups + g] = step * static_cast<float>(sum);
    }
  }
}

// R rows' group (one record): D per channel by integer dot products, then each row's fp32 totals
// += float(D - 8 S) * (scale * d) + zero * (d * S). ``xs[r]``: row r's 32 quantized values.
template <int R>
inline void rows_group(const uint8_t* record, const int8_t* const* xs, const float* steps, const int32_t* sums,
                       const float* step_sums, const __m256* scales, float* const* totals) {
  __m256i first[R], second[R];  // int16 sums of chunks 0-3 and 4-7 per channel
  for (int r = 0; r < R; ++r) first[r] = second[r] = _mm256_setzero_si256();
  const __m256i low = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 8
  for (int c = 0; c < kChunks; ++c) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 32 * c));
    const __m256i q01 = _mm256_and_si256(bytes, low);  // per channel: inputs 4c, 4c + 1
    const __m256i q23 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);  // inputs 4c + 2, 4c + 3
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int16_t x01, x23;
      std::memcpy(&x01, xs[r] + 4 * c, 2);
      std::memcpy(&x23, xs[r] + 4 * c + 2, 2);
      const __m256i dot = _mm256_add_epi16(_mm256_maddubs_epi16(q01, _mm256_set1_epi16(x01)),
                                           _mm256_maddubs_epi16(q23, _mm256_set1_epi16(x23)));
      if (c < kChunks / 2) {
        first[r] = _mm256_add_epi16(first[r], dot);
      } else {
        second[r] = _mm256_add_epi16(second[r], dot);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256i minus8s = _mm256_set1_epi32(-8 * sums[r]);
    const __m256i t_lo = _mm256_add_epi32(_mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(first[r])),
                                                           _mm256_cvtepi16_epi32(_mm256_castsi256_si128(second[r]))),
                                          minus8s);  // channels 0-7
    const __m256i t_hi = _mm256_add_epi32(
        _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(first[r], 1)),
                         _mm256_cvtepi16_epi32(_mm256_extracti128_si256(second[r], 1))),
        minus8s);  // channels 8-15
    const __m256 step = _mm256_set1_ps(steps[r]), step_sum = _mm256_set1_ps(step_sums[r]);
    float* total = totals[r];
    const __m256 lo =
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(t_lo), _mm256_mul_ps(scales[0], step), _mm256_loadu_ps(total));
    const __m256 hi =
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(t_hi), _mm256_mul_ps(scales[1], step), _mm256_loadu_ps(total + 8));
    _mm256_storeu_ps(total, _mm256_fmadd_ps(scales[2], step_sum, lo));
    _mm256_storeu_ps(total + 8, _mm256_fmadd_ps(scales[3], step_sum, hi));
  }
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
    // [rows, 16] fp32 sums of the current block, on cache lines of this thread's own (64-byte aligned,
    // padded): the threads write their sums after every record
    std::vector<float> storage(rows * kBlock + 2 * kLine);
    float* totals = storage.data() + (kLine - (reinterpret_cast<uintptr_t>(storage.data()) / sizeof(float)) % kLine);
    for (int64_t b = begin; b < end; ++b) {
      std::fill(totals, totals + rows * kBlock, 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t index = b * groups + g;
        const uint8_t* record = weights + index * kBytes;
        const uint8_t* ahead = weights + std::min(index + kAhead, last) * kBytes;
        for (int64_t line = 0; line < kBytes; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
        }
        const __m256 scales[4] = {bf16_to_fp32(record + kNibbles), bf16_to_fp32(record + kNibbles + 16),
                                  bf16_to_fp32(record + kNibbles + 32), bf16_to_fp32(record + kNibbles + 48)};
        for (int64_t m = 0; m < rows; m += kRowsAtOnce) {
          const int count = static_cast<int>(std::min<int64_t>(kRowsAtOnce, rows - m));
          const int8_t* xs[kRowsAtOnce];
          float* row_totals[kRowsAtOnce];
          float steps[kRowsAtOnce], step_sums[kRowsAtOnce];
          int32_t sums[kRowsAtOnce];
          for (int r = 0; r < count; ++r) {
            const int64_t at = (m + r) * groups + g;
            xs[r] = q.values.data() + (m + r) * in_features + g * kGroup;
            row_totals[r] = totals + (m + r) * kBlock;
            steps[r] = q.step[at];
            sums[r] = q.sum[at];
            step_sums[r] = q.step_sum[at];
          }
          if (count == 1) rows_group<1>(record, xs, steps, sums, step_sums, scales, row_totals);
          if (count == 2) rows_group<2>(record, xs, steps, sums, step_sums, scales, row_totals);
          if (count == 3) rows_group<3>(record, xs, steps, sums, step_sums, scales, row_totals);
          if (count == 4) rows_group<4>(record, xs, steps, sums, step_sums, scales, row_totals);
        }
      }
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t n = 0; n < kBlock; ++n) {
          result[m * out_features + b * kBlock + n] = c10::BFloat16(totals[m * kBlock + n]);
        }
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------- int8 weights x int8 activations (the AVX2 build only)
//
// y = scale * sum over inputs of q x, q int8 in [-127, 127] per output channel (torch's format, scales in bf16),
// for the LM heads of quantized models where oneDNN takes no bf16 weights. The activations are rounded as for
// int4 (quantize_rows: per row and group of 32 inputs, x ~ d * xi). Records: per block of 8 channels and group
// of 32 inputs, each channel's 32 weights in input order ([out / 8, in / 32, 8, 32] bytes, 256 per record).
// Per (row, record): vpsignb puts the signs of the row's xi on each channel's q, vpmaddubsw multiplies |xi| by
// them in adjacent pairs (|.| <= 2 * 127 * 127 = 32258: no saturation), vpmaddwd adds the pairs into 8 int32
// lanes, and integer horizontal adds leave lane c = channel c's D = sum of xi q over the group, exact. Then per
// channel total += float(D) * d (fp32, exact conversion: |D| <= 32 * 127 * 127), group by group in input order;
// at the end total * scale, rounded once to bf16. The arithmetic llama.cpp runs for Q8_0 x Q8_0; a row's
// instructions do not depend on the call's other rows or threads (row-invariant, tested).
// Measured, the default model's head (49152 x 576), 2 threads, ms at 1 / 2 / 3 / 4 / 8 rows: fp32 multiply-adds
// (before, stop 23) 1.71 / 2.48 / 3.04 / 3.42 / 5.14, these integer products 1.12 / 1.72 / 1.76 / 1.75 / 3.67.

constexpr int64_t kInt8Channels = 8;  // channels per int8 record (one int32 lane each)
constexpr int64_t kInt8Record = kInt8Channels * kGroup;  // bytes

// Lane c of the result: the sum of the 8 lanes of sums[c] (integer adds, exact in any order).
inline __m256i channel_sums(const __m256i* sums) {
  const __m256i s01 = _mm256_hadd_epi32(sums[0], sums[1]), s23 = _mm256_hadd_epi32(sums[2], sums[3]);
  const __m256i s45 = _mm256_hadd_epi32(sums[4], sums[5]), s67 = _mm256_hadd_epi32(sums[6], sums[7]);
  const __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                          _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

// R rows' totals over one block of 8 channels (all its groups). ``xs[r]``, ``magnitudes[r]``: row r's
// rounded activations and their absolute values; ``steps[r]``: its d per group.
template <int R>
inline void int8_rows_block(const int8_t* block, int64_t groups, const int8_t* const* xs,
                            const int8_t* const* magnitudes, const float* const* steps, __m256* totals) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) totals[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* record = block + g * kInt8Record;
    for (int64_t line = 0; line < kInt8Record; line += 64) {  // (a prefetch past the weights' end does not fault)
      _mm_prefetch(reinterpret_cast<const char*>(record + kAhead * kInt8Record + line), _MM_HINT_T0);
    }
    __m256i weights[kInt8Channels];
    for (int c = 0; c < kInt8Channels; ++c) {
      weights[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + kGroup * c));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r] + g * kGroup));
      const __m256i magnitude = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(magnitudes[r] + g * kGroup));
      __m256i sums[kInt8Channels];
      for (int c = 0; c < kInt8Channels; ++c) {
        sums[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(weights[c], x)), ones);
      }
      totals[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(channel_sums(sums)), _mm256_set1_ps(steps[r][g]), totals[r]);
    }
  }
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int8_mm: x must be [m, k] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kInt8Channels && packed.size(3) == kGroup, "int8_mm: bad packed");
  TORCH_CHECK(packed.size(1) * kGroup == x.size(1), "int8_mm: packed does not fit x");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == packed.size(0) * kInt8Channels &&
                  scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(), "int8_mm: scales must be [out] bf16");
  const int64_t rows = x.size(0), in_features = x.size(1), blocks = packed.size(0), groups = packed.size(1);
  const int64_t out_features = blocks * kInt8Channels;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  QuantizedRows q;
  quantize_rows(x.data_ptr<at::BFloat16>(), rows, in_features, q);
  const int8_t* weights = packed.data_ptr<int8_t>();
  const c10::BFloat16* channel_scales = scales.data_ptr<at::BFloat16>();
  auto* result = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* block = weights + b * groups * kInt8Record;
      alignas(32) float scale_values[kInt8Channels];
      for (int c = 0; c < kInt8Channels; ++c) scale_values[c] = static_cast<float>(channel_scales[b * kInt8Channels + c]);
      const __m256 block_scales = _mm256_load_ps(scale_values);
      for (int64_t m = 0; m < rows; m += kRowsAtOnce) {
        const int count = static_cast<int>(std::min<int64_t>(kRowsAtOnce, rows - m));
        const int8_t* xs[kRowsAtOnce];
        const int8_t* magnitudes[kRowsAtOnce];
        const float* steps[kRowsAtOnce];
        for (int r = 0; r < count; ++r) {
          xs[r] = q.values.data() + (m + r) * in_features;
          magnitudes[r] = q.magnitudes.data() + (m + r) * in_features;
          steps[r] = q.step.data() + (m + r) * groups;
        }
        __m256 totals[kRowsAtOnce];
        if (count == 1) int8_rows_block<1>(block, groups, xs, magnitudes, steps, totals);
        if (count == 2) int8_rows_block<2>(block, groups, xs, magnitudes, steps, totals);
        if (count == 3) int8_rows_block<3>(block, groups, xs, magnitudes, steps, totals);
        if (count == 4) int8_rows_block<4>(block, groups, xs, magnitudes, steps, totals);
        for (int r = 0; r < count; ++r) {
          alignas(32) float values[kInt8Channels];
          _mm256_store_ps(values, _mm256_mul_ps(totals[r], block_scales));
          c10::BFloat16* target = result + (m + r) * out_features + b * kInt8Channels;
          for (int c = 0; c < kInt8Channels; ++c) target[c] = c10::BFloat16(values[c]);
        }
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------- bf16 weights x bf16 (the AVX2 build only)
//
// y = sum over inputs of w x, for bf16 models' linears on CPUs without native bf16 products (there torch's
// bf16 products run through a generic kernel, ~5x slower than this). Records: per block of 16
// channels, for each input its 16 channels' weights ([out / 16, in, 16]). Two chains per half (even
// and odd inputs), in input order. Calls of 1-2 rows widen the weights in registers for the pair;
// longer calls widen kWideChunk inputs of a block at a time into a buffer and run the rows in threes
// from it, carrying the chains across chunks. A row's chains get the same multiply-adds in the same
// order either way, so its result does not depend on the other rows (row-invariant).
// Measured (stop 23, the int8 head then ran this code): 4 / 8 / 16 rows 5.1 / 9.6 / 20.1 ms -> 4.1 / 4.8 / 11.8 ms
// (widening once per chunk instead of once per pair); 1-2 rows unchanged.

constexpr int64_t kWideChunk = 64;  // inputs widened at once (64 x 16 fp32: 4 KB, in L1)

// Half h's 8 channels of one input of a block, as fp32.
inline __m256 widen(const c10::BFloat16* input, int h) {
  return bf16_to_fp32(reinterpret_cast<const uint8_t*>(input + 8 * h));
}

// A row's 16 outputs from its chains: (even + odd) per half.
inline void finish_row(__m256 even_lo, __m256 even_hi, __m256 odd_lo, __m256 odd_hi, c10::BFloat16* out) {
  alignas(32) float values[kBlock];
  _mm256_store_ps(values, _mm256_add_ps(even_lo, odd_lo));
  _mm256_store_ps(values + 8, _mm256_add_ps(even_hi, odd_hi));
  for (int n = 0; n < kBlock; ++n) out[n] = c10::BFloat16(values[n]);
}

template <int R>
inline void wide_rows(const c10::BFloat16* block, int64_t in_features, const float* const* rows,
                      c10::BFloat16* const* out) {
  __m256 even_lo[R], odd_lo[R], even_hi[R], odd_hi[R];
  for (int r = 0; r < R; ++r) even_lo[r] = odd_lo[r] = even_hi[r] = odd_hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in_features; i += 2) {
#pragma GCC unroll 2
    for (int t = 0; t < 2; ++t) {
      const c10::BFloat16* input = block + (i + t) * kBlock;
      slot_step<R>(t, widen(input, 0), widen(input, 1), rows, i + t, even_lo, even_hi, odd_lo, odd_hi);
    }
  }
  for (int r = 0; r < R; ++r) finish_row(even_lo[r], even_hi[r], odd_lo[r], odd_hi[r], out[r]);
}

// R rows' chains over ``count`` widened inputs (``offset`` the first's index), carried in ``chains``
// (per row: even_lo, even_hi, odd_lo, odd_hi, 8 floats each): the multiply-adds of wide_rows.
template <int R>
inline void rows_widened(const float* widened, int64_t count, int64_t offset, const float* const* rows,
                         float* const* chains) {
  __m256 even_lo[R], odd_lo[R], even_hi[R], odd_hi[R];
  for (int r = 0; r < R; ++r) {
    even_lo[r] = _mm256_loadu_ps(chains[r]);
    even_hi[r] = _mm256_loadu_ps(chains[r] + 8);
    odd_lo[r] = _mm256_loadu_ps(chains[r] + 16);
    odd_hi[r] = _mm256_loadu_ps(chains[r] + 24);
  }
  for (int64_t i = 0; i < count; i += 2) {
#pragma GCC unroll 2
    for (int t = 0; t < 2; ++t) {
      const float* w = widened + (i + t) * kBlock;
      slot_step<R>(t, _mm256_load_ps(w), _mm256_load_ps(w + 8), rows, offset + i + t, even_lo, even_hi, odd_lo,
                   odd_hi);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(chains[r], even_lo[r]);
    _mm256_storeu_ps(chains[r] + 8, even_hi[r]);
    _mm256_storeu_ps(chains[r] + 16, odd_lo[r]);
    _mm256_storeu_ps(chains[r] + 24, odd_hi[r]);
  }
}

// Calls of 3+ rows: each block's inputs widened kWideChunk at a time, rows in threes (the last one
// or two alone or as a pair); the chains' sums as wide_rows ends them.
void block_widened(const c10::BFloat16* block, int64_t rows, int64_t in_features, const float* xs,
                   int64_t out_features, c10::BFloat16* result, float* widened, std::vector<float>& chains) {
  std::fill(chains.begin(), chains.end(), 0.0f);
  for (int64_t start = 0; start < in_features; start += kWideChunk) {
    const int64_t count = std::min(kWideChunk, in_features - start);
    for (int64_t i = 0; i < count; ++i) {
      const c10::BFloat16* input = block + (start + i) * kBlock;
      for (int h = 0; h < 2; ++h) _mm256_store_ps(widened + i * kBlock + 8 * h, widen(input, h));
    }
    for (int64_t m = 0; m < rows; m += 3) {
      const int64_t m1 = std::min(m + 1, rows - 1), m2 = std::min(m + 2, rows - 1);
      const float* trio[3] = {xs + m * in_features, xs + m1 * in_features, xs + m2 * in_features};
      float* trio_chains[3] = {chains.data() + m * 32, chains.data() + m1 * 32, chains.data() + m2 * 32};
      const int64_t n = std::min<int64_t>(3, rows - m);
      if (n == 3) rows_widened<3>(widened, count, start, trio, trio_chains);
      if (n == 2) rows_widened<2>(widened, count, start, trio, trio_chains);
      if (n == 1) rows_widened<1>(widened, count, start, trio, trio_chains);
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const float* c = chains.data() + m * 32;
    finish_row(_mm256_loadu_ps(c), _mm256_loadu_ps(c + 8), _mm256_loadu_ps(c + 16), _mm256_loadu_ps(c + 24),
               result + m * out_features);
  }
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "bf16_mm: x must be [m, k] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kBlock, "bf16_mm: bad packed");
  TORCH_CHECK(packed.size(1) == x.size(1) && x.size(1) % 2 == 0, "bf16_mm: packed does not fit x");
  const int64_t rows = x.size(0), in_features = x.size(1), blocks = packed.size(0);
  const int64_t out_features = blocks * kBlock;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  std::vector<float> xs(rows * in_features);
  const c10::BFloat16* in = x.data_ptr<at::BFloat16>();
  for (int64_t j = 0; j < rows * in_features; ++j) xs[j] = static_cast<float>(in[j]);
  const auto* weights = packed.data_ptr<at::BFloat16>();
  auto* result = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float widened[kWideChunk * kBlock];
    std::vector<float> chains(rows > 2 ? rows * 32 : 0);
    for (int64_t b = begin; b < end; ++b) {
      const c10::BFloat16* block = weights + b * in_features * kBlock;
      if (rows > 2) {
        block_widened(block, rows, in_features, xs.data(), out_features, result + b * kBlock, widened, chains);
        continue;
      }
      for (int64_t m = 0; m < rows; m += 2) {
        const int64_t next = std::min(m + 1, rows - 1);  // the pair, or the last row alone
        const float* pair[2] = {xs.data() + m * in_features, xs.data() + next * in_features};
        c10::BFloat16* targets[2] = {result + m * out_features + b * kBlock, result + next * out_features + b * kBlock};
        if (next == m) {
          wide_rows<1>(block, in_features, pair, targets);
        } else {
          wide_rows<2>(block, in_features, pair, targets);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(causaldraft, m) {
  m.def("int4_mm(Tensor x, Tensor packed) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("bf16_mm(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(causaldraft, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("bf16_mm", &bf16_mm);
}
