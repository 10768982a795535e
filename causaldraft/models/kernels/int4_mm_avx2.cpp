// int4 weight x bf16 activation product for CPUs with AVX2 and FMA but no AVX-512 bf16 (e.g. AMD
// Zen 3), on the same records as int4_mm.cpp (causaldraft/models/int4_kernel.py has the layout,
// docs/int4-kernel.md the arithmetic). fp32 multiply-adds instead of bf16 dot products.
//
// A record's 16 bytes of a chunk c and half h, widened to 8 dwords, hold in dword n (channel
// 8h + n) four nibbles: bits 0-3 input 4c, 4-7 input 4c + 2, 8-11 input 4c + 1, 12-15 input 4c + 3.
// Each nibble is converted in place (masked, not shifted): the float of (d & 0xF0) is 16 q, and
// the activation it meets is divided by 16 beforehand, so the product is q x exactly (powers of
// two); likewise 256 and 4096. Each row's group dot product D = sum q x runs in two fixed chains
// per half, then T = D - 8 S (S the row's sum over the group), total += T * scale + S * zero.
// A row's instructions are the same whether it comes in a pair or alone, and whether the record is
// unpacked into registers (calls of up to 4 rows) or once into a buffer (more rows), so its result
// does not depend on the other rows of the call; threads split output blocks.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // output channels per block (two ymm of fp32 lanes)
constexpr int64_t kGroup = 32;  // inputs per quantization group
constexpr int64_t kChunks = kGroup / 4;  // 32-byte chunks of a record, 4 inputs each
constexpr int64_t kNibbles = kBlock * kGroup / 2;  // bytes of int4 values per (block, group)
constexpr int64_t kBytes = kNibbles + 4 * kBlock;  // + 16 bf16 scales + 16 bf16 zeros
constexpr int64_t kAhead = 8;  // records prefetched ahead of the one being read
// calls of up to this many rows unpack each record in registers (per pair of rows); longer calls
// unpack it once into a buffer. Measured, 120 products of a pass: 3 and 4 rows cost 10.7 and 12.6 ms
// through the buffer against 13.0 and 16.1 ms unpacked per pair; 1 and 2 rows the same either way.
constexpr int64_t kDirectRows = 2;
constexpr int64_t kLine = 64 / sizeof(float);  // floats per cache line

// Slot k of a chunk (the order the nibbles sit in a dword): its input offset and scale factor.
constexpr int kOffset[4] = {0, 2, 1, 3};
constexpr float kFactor[4] = {1.0f, 1.0f / 16, 1.0f / 256, 1.0f / 4096};
constexpr uint32_t kMask[4] = {0xF, 0xF0, 0xF00, 0xF000};

// The record's weights as floats [32 slots][16 channels]: slot 4c + k holds 2^(4k) q at input
// 4c + kOffset[k].
inline void unpack(const uint8_t* bytes, float* weights) {
  for (int c = 0; c < kChunks; ++c) {
    for (int h = 0; h < 2; ++h) {
      const __m256i words =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 32 * c + 16 * h)));
      for (int k = 0; k < 4; ++k) {
        const __m256i nibble = _mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(kMask[k])));
        _mm256_store_ps(weights + (4 * c + k) * kBlock + 8 * h, _mm256_cvtepi32_ps(nibble));
      }
    }
  }
}

inline __m256 bf16_to_fp32(const uint8_t* bytes) {
  __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}

// The end of one row's group: T = D - 8 S per half, then total += T * scale + S * zero.
inline void finish(__m256 even_lo, __m256 odd_lo, __m256 even_hi, __m256 odd_hi, float sum, const __m256* scales,
                   float* total) {
  const __m256 s = _mm256_set1_ps(sum), minus8s = _mm256_set1_ps(-8.0f * sum);
  const __m256 t_lo = _mm256_add_ps(_mm256_add_ps(even_lo, odd_lo), minus8s);
  const __m256 t_hi = _mm256_add_ps(_mm256_add_ps(even_hi, odd_hi), minus8s);
  const __m256 lo = _mm256_fmadd_ps(t_lo, scales[0], _mm256_loadu_ps(total));
  const __m256 hi = _mm256_fmadd_ps(t_hi, scales[1], _mm256_loadu_ps(total + 8));
  _mm256_storeu_ps(total, _mm256_fmadd_ps(scales[2], s, lo));
  _mm256_storeu_ps(total + 8, _mm256_fmadd_ps(scales[3], s, hi));
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

// R rows' groups from the unpacked record: D = sum over slots of w * x' in two chains per half
// (even and odd slots), in slot order; the weights are loaded once for the R rows.
template <int R>
inline void rows_group(const float* weights, const float* const* slots, const float* sums, const __m256* scales,
                       float* const* totals) {
  __m256 even_lo[R], odd_lo[R], even_hi[R], odd_hi[R];
  for (int r = 0; r < R; ++r) even_lo[r] = odd_lo[r] = even_hi[r] = odd_hi[r] = _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int p = 0; p < kGroup; ++p) {  // one slot at a time, as rows_group_direct
    const __m256 w_lo = _mm256_load_ps(weights + p * kBlock), w_hi = _mm256_load_ps(weights + p * kBlock + 8);
    slot_step<R>(p, w_lo, w_hi, slots, p, even_lo, even_hi, odd_lo, odd_hi);
  }
  for (int r = 0; r < R; ++r) finish(even_lo[r], odd_lo[r], even_hi[r], odd_hi[r], sums[r], scales, totals[r]);
}

// R rows' groups straight from the record's bytes, each chunk unpacked into registers: the same
// chains in the same order as rows_group (for calls of few rows, where unpacking once into a
// buffer costs more than unpacking once per pair of rows).
template <int R>
inline void rows_group_direct(const uint8_t* bytes, const float* const* slots, const float* sums,
                              const __m256* scales, float* const* totals) {
  __m256 even_lo[R], odd_lo[R], even_hi[R], odd_hi[R];
  for (int r = 0; r < R; ++r) even_lo[r] = odd_lo[r] = even_hi[r] = odd_hi[r] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < kChunks; ++c) {
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 32 * c)));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 32 * c + 16)));
    // one slot at a time: 8 accumulators, 2 words, 2 weights and a broadcast stay in registers
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i mask = _mm256_set1_epi32(static_cast<int>(kMask[k]));
      const __m256 w_lo = _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask));
      const __m256 w_hi = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
      slot_step<R>(k, w_lo, w_hi, slots, 4 * c + k, even_lo, even_hi, odd_lo, odd_hi);
    }
  }
  for (int r = 0; r < R; ++r) finish(even_lo[r], odd_lo[r], even_hi[r], odd_hi[r], sums[r], scales, totals[r]);
}

// Each row's inputs as fp32 in slot order and scaled ([rows, in]), and its sums per group
// ([rows, groups], summed in input order).
void prepare(const c10::BFloat16* x, int64_t rows, int64_t in_features, std::vector<float>& slots,
             std::vector<float>& sums) {
  const int64_t groups = in_features / kGroup;
  slots.resize(rows * in_features);
  sums.resize(rows * groups);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const c10::BFloat16* in = x + m * in_features + g * kGroup;
      float* out = slots.data() + m * in_features + g * kGroup;
      float sum = 0.0f;
      for (int i = 0; i < kGroup; ++i) sum += static_cast<float>(in[i]);
      sums[m * groups + g] = sum;
      for (int c = 0; c < kChunks; ++c) {
        for (int k = 0; k < 4; ++k) out[4 * c + k] = static_cast<float>(in[4 * c + kOffset[k]]) * kFactor[k];
      }
    }
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
  std::vector<float> slots, sums;
  prepare(x.data_ptr<at::BFloat16>(), rows, in_features, slots, sums);
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  auto* result = out.data_ptr<at::BFloat16>();
  const int64_t out_features = blocks * kBlock;
  const int64_t last = blocks * groups - 1;  // the last record (prefetches stay within the weights)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float unpacked[kGroup * kBlock];
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
        const float* row_slots = slots.data() + g * kGroup;  // row m's at + m * in_features
        const bool direct = rows <= kDirectRows;
        if (!direct) unpack(record, unpacked);
        for (int64_t m = 0; m < rows; m += 2) {
          const int64_t next = std::min(m + 1, rows - 1);  // the pair, or the last row alone
          const float* pair[2] = {row_slots + m * in_features, row_slots + next * in_features};
          const float pair_sums[2] = {sums[m * groups + g], sums[next * groups + g]};
          float* pair_totals[2] = {totals + m * kBlock, totals + next * kBlock};
          if (next == m && direct) rows_group_direct<1>(record, pair, pair_sums, scales, pair_totals);
          if (next == m && !direct) rows_group<1>(unpacked, pair, pair_sums, scales, pair_totals);
          if (next != m && direct) rows_group_direct<2>(record, pair, pair_sums, scales, pair_totals);
          if (next != m && !direct) rows_group<2>(unpacked, pair, pair_sums, scales, pair_totals);
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


// ---------------------------------------------------------------- int8 or bf16 weights x bf16 (the AVX2 build only)
//
// int8: y = scale * sum over inputs of q x, q int8 per output channel (torch's int8 format, scales
// in bf16), for the LM heads of quantized models where oneDNN takes no bf16 weights. bf16: y = sum
// over inputs of w x, for bf16 models' linears on CPUs without native bf16 products (there torch's
// bf16 products run through a generic kernel, ~5x slower than this). Records: per block of 16
// channels, for each input its 16 channels' weights ([out / 16, in, 16]). Two chains per half (even
// and odd inputs), in input order. Calls of 1-2 rows widen the weights in registers for the pair;
// longer calls widen kWideChunk inputs of a block at a time into a buffer and run the rows in threes
// from it, carrying the chains across chunks. A row's chains get the same multiply-adds in the same
// order either way, so its result does not depend on the other rows (row-invariant).
// Measured, the default model's LM head: 4 / 8 / 16 rows 5.1 / 9.6 / 20.1 ms -> 4.1 / 4.8 / 11.8 ms
// (widening once per chunk instead of once per pair); 1-2 rows unchanged.

constexpr int64_t kWideChunk = 64;  // inputs widened at once (64 x 16 fp32: 4 KB, in L1)

// The weight formats: bytes per input of a block, and half h's 8 channels of one input as fp32.
struct Int8Weight {
  using Type = int8_t;
  static constexpr bool kScaled = true;
  static inline __m256 widen(const Type* input, int h) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(input + 8 * h))));
  }
};

struct Bf16Weight {
  using Type = c10::BFloat16;
  static constexpr bool kScaled = false;
  static inline __m256 widen(const Type* input, int h) {
    return bf16_to_fp32(reinterpret_cast<const uint8_t*>(input + 8 * h));
  }
};

// A row's 16 outputs from its chains: (even + odd) per half, times the channel scales (int8).
template <typename W>
inline void finish_row(__m256 even_lo, __m256 even_hi, __m256 odd_lo, __m256 odd_hi, const __m256* scales,
                       c10::BFloat16* out) {
  alignas(32) float values[kBlock];
  const __m256 lo = _mm256_add_ps(even_lo, odd_lo), hi = _mm256_add_ps(even_hi, odd_hi);
  _mm256_store_ps(values, W::kScaled ? _mm256_mul_ps(lo, scales[0]) : lo);
  _mm256_store_ps(values + 8, W::kScaled ? _mm256_mul_ps(hi, scales[1]) : hi);
  for (int n = 0; n < kBlock; ++n) out[n] = c10::BFloat16(values[n]);
}

template <typename W, int R>
inline void wide_rows(const typename W::Type* block, int64_t in_features, const float* const* rows,
                      const __m256* scales, c10::BFloat16* const* out) {
  __m256 even_lo[R], odd_lo[R], even_hi[R], odd_hi[R];
  for (int r = 0; r < R; ++r) even_lo[r] = odd_lo[r] = even_hi[r] = odd_hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in_features; i += 2) {
#pragma GCC unroll 2
    for (int t = 0; t < 2; ++t) {
      const typename W::Type* input = block + (i + t) * kBlock;
      slot_step<R>(t, W::widen(input, 0), W::widen(input, 1), rows, i + t, even_lo, even_hi, odd_lo, odd_hi);
    }
  }
  for (int r = 0; r < R; ++r) finish_row<W>(even_lo[r], even_hi[r], odd_lo[r], odd_hi[r], scales, out[r]);
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
template <typename W>
void block_widened(const typename W::Type* block, int64_t rows, int64_t in_features, const float* xs,
                   const __m256* scales, int64_t out_features, c10::BFloat16* result, float* widened,
                   std::vector<float>& chains) {
  std::fill(chains.begin(), chains.end(), 0.0f);
  for (int64_t start = 0; start < in_features; start += kWideChunk) {
    const int64_t count = std::min(kWideChunk, in_features - start);
    for (int64_t i = 0; i < count; ++i) {
      const typename W::Type* input = block + (start + i) * kBlock;
      for (int h = 0; h < 2; ++h) _mm256_store_ps(widened + i * kBlock + 8 * h, W::widen(input, h));
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
    finish_row<W>(_mm256_loadu_ps(c), _mm256_loadu_ps(c + 8), _mm256_loadu_ps(c + 16), _mm256_loadu_ps(c + 24),
                  scales, result + m * out_features);
  }
}

// x [rows, in] bf16 times the records [out / 16, in, 16] (with per-channel bf16 scales for int8).
template <typename W>
at::Tensor wide_mm(const at::Tensor& x, const at::Tensor& packed, const uint8_t* scale_bytes) {
  const int64_t rows = x.size(0), in_features = x.size(1), blocks = packed.size(0);
  const int64_t out_features = blocks * kBlock;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  std::vector<float> xs(rows * in_features);
  const c10::BFloat16* in = x.data_ptr<at::BFloat16>();
  for (int64_t j = 0; j < rows * in_features; ++j) xs[j] = static_cast<float>(in[j]);
  const auto* weights = reinterpret_cast<const typename W::Type*>(packed.data_ptr());
  auto* result = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float widened[kWideChunk * kBlock];
    std::vector<float> chains(rows > 2 ? rows * 32 : 0);
    for (int64_t b = begin; b < end; ++b) {
      const typename W::Type* block = weights + b * in_features * kBlock;
      __m256 block_scales[2] = {_mm256_set1_ps(1.0f), _mm256_set1_ps(1.0f)};
      if (W::kScaled) {
        block_scales[0] = bf16_to_fp32(scale_bytes + 2 * b * kBlock);
        block_scales[1] = bf16_to_fp32(scale_bytes + 2 * b * kBlock + 16);
      }
      if (rows > 2) {
        block_widened<W>(block, rows, in_features, xs.data(), block_scales, out_features, result + b * kBlock,
                         widened, chains);
        continue;
      }
      for (int64_t m = 0; m < rows; m += 2) {
        const int64_t next = std::min(m + 1, rows - 1);  // the pair, or the last row alone
        const float* pair[2] = {xs.data() + m * in_features, xs.data() + next * in_features};
        c10::BFloat16* targets[2] = {result + m * out_features + b * kBlock, result + next * out_features + b * kBlock};
        if (next == m) {
          wide_rows<W, 1>(block, in_features, pair, block_scales, targets);
        } else {
          wide_rows<W, 2>(block, in_features, pair, block_scales, targets);
        }
      }
    }
  });
  return out;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int8_mm: x must be [m, k] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kBlock, "int8_mm: bad packed");
  TORCH_CHECK(packed.size(1) == x.size(1) && x.size(1) % 2 == 0, "int8_mm: packed does not fit x");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == packed.size(0) * kBlock &&
                  scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(), "int8_mm: scales must be [out] bf16");
  return wide_mm<Int8Weight>(x, packed, reinterpret_cast<const uint8_t*>(scales.data_ptr<at::BFloat16>()));
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "bf16_mm: x must be [m, k] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kBlock, "bf16_mm: bad packed");
  TORCH_CHECK(packed.size(1) == x.size(1) && x.size(1) % 2 == 0, "bf16_mm: packed does not fit x");
  return wide_mm<Bf16Weight>(x, packed, nullptr);
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
