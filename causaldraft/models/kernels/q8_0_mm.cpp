// Q8_0 weight x bf16 activation product (the LM head of a GGUF model stored as Q8_0), fp32 out.
//
// See causaldraft/models/q8_0_head.py for the layout and the arithmetic (docs/q8_0-head.md).
// Each record (16 output channels, 32 inputs) is widened to bf16 once per tile of up to 8 rows and used
// for every row of the tile. Every output element is computed by the same instruction sequence whatever the row count and the thread
// count, so a row's result does not depend on the other rows of the call (row invariance). Where __AMX_BF16__ is
// defined (the AMX build, since stop 46) every call goes through tiles instead (namespace amx, below).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kChannels = 16;  // output channels per record (one zmm of fp32 lanes)
constexpr int64_t kGroup = 32;  // inputs per Q8_0 block
constexpr int64_t kPairs = kGroup / 2;  // bf16 pairs per block (one dot-product step each)
constexpr int64_t kValues = kChannels * kGroup;  // int8 bytes per record
constexpr int64_t kBytes = kValues + 2 * kChannels;  // + 16 fp16 scales
constexpr int64_t kAhead = 8;  // records prefetched ahead of the one being read
constexpr int kMaxRows = 8;  // rows per register tile

// Operand p of a record: word 2n+t is the value of channel n at input 2p+t, as bf16 (exact: integers
// of at most 8 bits).
inline __m512bh widen(const uint8_t* record, int p) {
  const __m128i* pair = reinterpret_cast<const __m128i*>(record + 32 * p);
  __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pair)));
  __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pair + 1)));
  return _mm512_cvtne2ps_pbh(high, low);
}

// R rows' sums over one record, scaled and added to their totals: two chains of dot products (even
// and odd pairs) per row, added, times the 16 scales, added to the total. The same arithmetic for a
// row whatever R is.
template <int R>
inline void rows_step(const uint32_t* const* rows, const uint8_t* record, __m512 scale, __m512* totals) {
  __m512 even[R], odd[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int p = 0; p < kPairs; p += 2) {
    const __m512bh first = widen(record, p), second = widen(record, p + 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(rows[r][p]), first);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(rows[r][p + 1]), second);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) totals[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), scale, totals[r]);
}

// Rows m .. m+R-1 of one block of 16 channels over all its records, into out.
template <int R>
void block_rows(const uint8_t* records, int64_t groups, const uint32_t* pairs, int64_t in_features, int64_t m,
                float* out, int64_t out_features, int64_t channel, const uint8_t* last) {
  __m512 totals[R];
  const uint32_t* rows[R];
  for (int r = 0; r < R; ++r) totals[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = records + g * kBytes;
    const uint8_t* ahead = std::min(record + kAhead * kBytes, last);
    for (int64_t line = 0; line < kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + kValues)));
    for (int r = 0; r < R; ++r) rows[r] = pairs + ((m + r) * in_features + g * kGroup) / 2;
    rows_step<R>(rows, record, scale, totals);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (m + r) * out_features + channel, totals[r]);
}

using Tile = void (*)(const uint8_t*, int64_t, const uint32_t*, int64_t, int64_t, float*, int64_t, int64_t,
                     const uint8_t*);
constexpr Tile kTiles[kMaxRows + 1] = {nullptr,        block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>,
                                       block_rows<5>, block_rows<6>, block_rows<7>, block_rows<8>};

#ifdef __AMX_BF16__
// The AMX build (where __AMX_BF16__ is defined and Linux grants the tiles): another order of the same fp32
// arithmetic, the same for every row count. Per record, its 16 pairs widened as above are the 16 rows of a B tile,
// the rows' 32 bf16 inputs of the block the rows of an A tile, and TDPBF16PS sums each row's 32 exact products per
// channel in fp32 into a zeroed C tile; then per row total = fma(C row, scale, total), record after record. A
// tile's element depends on its row of A and column of B alone, so a row's bits do not depend on the call's
// other rows.
namespace amx {

constexpr int64_t kRows = 16;  // rows of an A and a C tile
constexpr int64_t kSpan = 6;   // records widened before their tile products run

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

inline bool permitted() {  // the process's permission to use AMX tile data (Linux, once per process)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// On this thread: tiles 0-3 C (``rows`` x 16 fp32), 4 and 5 A (``rows`` x 32 bf16), 6 and 7 B (16 pairs x 16
// channels).
inline void configure(int64_t rows) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t >= 6 ? kPairs : rows);
  }
  _tile_loadconfig(&config);
}

struct alignas(64) Scratch {
  uint16_t b[kSpan][kPairs * 2 * kChannels];  // widened records
  float c[kSpan][kRows * kChannels];          // their rows' sums
};

#define CAUSALDRAFT_RECORD_TILE(C, A, B, a, stride, b, c) \
  do {                                                   \
    _tile_zero(C);                                       \
    _tile_loadd(A, a, stride);                           \
    _tile_loadd(B, b, 64);                               \
    _tile_dpbf16ps(C, A, B);                             \
    _tile_stored(C, c, 64);                              \
  } while (false)

// Rows m .. m + count - 1 (count <= tile rows) of one block over all its records, into out. ``x`` holds whole
// tiles of rows (rows past the call's are zeros).
void block_rows(const uint8_t* records, int64_t groups, const uint16_t* x, int64_t in_features, int64_t m,
                int64_t count, float* out, int64_t out_features, int64_t channel, const uint8_t* last,
                Scratch& scratch) {
  __m512 totals[kRows];
  for (int64_t r = 0; r < count; ++r) totals[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += kSpan) {
    const int64_t span = std::min(kSpan, groups - g0);
    for (int64_t s = 0; s < span; ++s) {
      const uint8_t* record = records + (g0 + s) * kBytes;
      const uint8_t* ahead = std::min(record + kAhead * kBytes, last);
      for (int64_t line = 0; line < kBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      }
      for (int p = 0; p < kPairs; ++p) {
        _mm512_store_si512(scratch.b[s] + p * 2 * kChannels, (__m512i)widen(record, p));
      }
    }
    for (int64_t s = 0; s < span; ++s) {
      const uint16_t* a = x + m * in_features + (g0 + s) * kGroup;
      switch (s % 2) {
        case 0: CAUSALDRAFT_RECORD_TILE(0, 4, 6, a, in_features * 2, scratch.b[s], scratch.c[s]); break;
        default: CAUSALDRAFT_RECORD_TILE(1, 5, 7, a, in_features * 2, scratch.b[s], scratch.c[s]); break;
      }
    }
    for (int64_t s = 0; s < span; ++s) {
      const uint8_t* record = records + (g0 + s) * kBytes;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + kValues)));
      for (int64_t r = 0; r < count; ++r) {
        totals[r] = _mm512_fmadd_ps(_mm512_load_ps(scratch.c[s] + r * kChannels), scale, totals[r]);
      }
    }
  }
  for (int64_t r = 0; r < count; ++r) _mm512_storeu_ps(out + (m + r) * out_features + channel, totals[r]);
}

#undef CAUSALDRAFT_RECORD_TILE

}  // namespace amx
#endif

at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "q8_0_mm: x must be [m, k] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(), "q8_0_mm: bad packed");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(groups * kGroup == in_features && packed.size(2) == kBytes, "q8_0_mm: packed does not fit x");
  const int64_t out_features = blocks * kChannels;
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  if (rows == 0) return out;
  const auto* pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());  // row m, pair i at m*k/2+i
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  const uint8_t* last = weights + (blocks * groups - 1) * kBytes;  // prefetches stay within the weights
  float* result = out.data_ptr<float>();
#ifdef __AMX_BF16__
  if (amx::permitted()) {
    // tiles of equal rows (at most 16): 20 rows are two tiles of 10; rows past the call's are zeros
    const int64_t tiles = (rows + amx::kRows - 1) / amx::kRows, tile_rows = (rows + tiles - 1) / tiles;
    const auto* inputs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    std::vector<uint16_t> padded;  // only where the last tile has rows past the call's
    if (tiles * tile_rows > rows) {
      padded.assign(tiles * tile_rows * in_features, 0);
      std::copy_n(inputs, rows * in_features, padded.data());
      inputs = padded.data();
    }
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      amx::configure(tile_rows);
      amx::Scratch scratch;
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t m = 0; m < rows; m += tile_rows) {
          amx::block_rows(weights + b * groups * kBytes, groups, inputs, in_features, m,
                          std::min(tile_rows, rows - m), result, out_features, b * kChannels, last, scratch);
        }
      }
      _tile_release();
    });
    return out;
  }
#endif
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* records = weights + b * groups * kBytes;
      const int64_t channel = b * kChannels;
      for (int64_t m = 0; m < rows; m += kMaxRows) {
        kTiles[std::min<int64_t>(rows - m, kMaxRows)](records, groups, pairs, in_features, m, result, out_features,
                                                      channel, last);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(causaldraft, m) { m.def("q8_0_mm(Tensor x, Tensor packed) -> Tensor"); }

TORCH_LIBRARY_IMPL(causaldraft, CPU, m) { m.impl("q8_0_mm", &q8_0_mm); }
