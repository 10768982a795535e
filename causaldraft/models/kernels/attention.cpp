// Row-invariant grouped-query attention over a KV cache in the blocked layout (causaldraft/models/blocked.py;
// docs/exactness.md): one task per (sequence, query head, row). The cache is fp32 (CPUs without native bf16
// products) or bf16 (with them): a bf16 entry is widened to fp32 exactly as it is loaded, so a bf16 cache
// gives the bits its numbers give in an fp32 one, and the arithmetic below is fp32 either way.
//
// A row attends to the slots it sees, in position order: the head's positions [0, T) where
// `seen` marks them (slot == position), then its tail positions by `tail_slots` where `seen`
// marks them. Its scores, softmax and weighted sum of values are computed by the same
// instructions in the same order whatever the other rows of the pass, the padding, the number of
// sequences or threads: a row's result depends on its query and the keys and values it sees alone.
//
// scores: s_j = (q . k_j) / sqrt(hd), each dot product in 8 lanes (fixed order, then a fixed
// horizontal sum); m = max s_j; e_j = exp(s_j - m) (a fixed polynomial, below); out = (sum_j e_j v_j) / (sum_j e_j).
//
// Two builds of that one arithmetic. The AVX2 build (attend_row) runs one task per (sequence, query head,
// row). The AVX-512 build (attend_group, compiled where __AVX512F__ is defined) runs one task per
// (sequence, kv head, row) for the query heads that share the kv head: it widens each key and value once
// for all of them, holds lanes 0-7 and 8-15 of the AVX2 build's two dot-product accumulators in one 16-lane
// register, and does eight keys' horizontal sums at once in the AVX2 build's order (sum8). Every lane
// sees the same operations in the same order as in the AVX2 build, so both builds give the same bits
// (tests/test_attention_kernel.py checks it). A third build, for bf16 caches of head size 64 where the CPU has
// AMX, has an arithmetic of its own (namespace amx below), as row-invariant.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// exp(x) for x <= 0 in 8 lanes: x = n ln2 + r (Cody-Waite), e^r by a degree-6 polynomial
// (relative error ~2e-7 on [-ln2/2, ln2/2]), times 2^n; below -87 gives 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  const __m256 zero_mask = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  return _mm256_andnot_ps(zero_mask, result);
}

// 8 cache entries as fp32 (a bf16 value is the top half of its fp32 bits: exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}

// One row of one query head: q [hd], the row's key/value slot list, out [hd].
template <typename Entry>
void attend_row(const float* q, const Entry* keys, const Entry* values, const int64_t* slots, int64_t count,
                int64_t hd, float scale, float* scores, float* out) {
  const int64_t lanes = hd / 8;
  __m256 query[16];
  for (int64_t l = 0; l < lanes; ++l) query[l] = _mm256_loadu_ps(q + 8 * l);
  float top = -INFINITY;
  for (int64_t j = 0; j < count; ++j) {
    const Entry* key = keys + slots[j] * hd;
    __m256 a = _mm256_mul_ps(query[0], load8(key));
    __m256 b = _mm256_mul_ps(query[1], load8(key + 8));
    for (int64_t l = 2; l < lanes; l += 2) {
      a = _mm256_fmadd_ps(query[l], load8(key + 8 * l), a);
      b = _mm256_fmadd_ps(query[l + 1], load8(key + 8 * l + 8), b);
    }
    const float score = horizontal_sum(_mm256_add_ps(a, b)) * scale;
    scores[j] = score;
    top = score > top ? score : top;
  }
  // exponentials in blocks of 8 (the last block padded with -inf: exp gives exact zeros)
  const int64_t padded = (count + 7) / 8 * 8;
  for (int64_t j = count; j < padded; ++j) scores[j] = -INFINITY;
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
    _mm256_storeu_ps(scores + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  const float total = horizontal_sum(sums);
  __m256 acc[16];
  for (int64_t l = 0; l < lanes; ++l) acc[l] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const Entry* value = values + slots[j] * hd;
    const __m256 w = _mm256_set1_ps(scores[j]);
    for (int64_t l = 0; l < lanes; ++l) acc[l] = _mm256_fmadd_ps(w, load8(value + 8 * l), acc[l]);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / total);
  for (int64_t l = 0; l < lanes; ++l) _mm256_storeu_ps(out + 8 * l, _mm256_mul_ps(acc[l], inverse));
}

#ifdef __AVX512F__
constexpr int64_t KEYS_PER_SUM = 8;  // keys whose horizontal sums are done together
constexpr int64_t MAX_GROUP_LANES = 16;  // accumulator registers of a head chunk: heads x hd / 16
constexpr int64_t MAX_CHUNK = 4;  // query heads per attend_group call

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// exp_nonpositive in 16 lanes: the same operations lane by lane.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 low = _mm512_set1_ps(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
  x = _mm512_max_ps(x, low);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_mul_ps(p, _mm512_castsi512_ps(exponent)));
}

// horizontal_sum of x[0..7] at once: ((x_0 + x_4) + (x_2 + x_6)) + ((x_1 + x_5) + (x_3 + x_7)) in each,
// the same additions as horizontal_sum (IEEE addition commutes), returned as [sum(x[0]), ..., sum(x[7])].
inline __m256 sum8(const __m256* x) {
  __m256 pairs[4];  // [x_a's 4 pair sums | x_b's]
  for (int k = 0; k < 4; ++k) {
    pairs[k] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * k], x[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(x[2 * k], x[2 * k + 1], 0x31));
  }
  __m256 twos[2];  // per 128-bit lane: [p0 + p2, p1 + p3] of two vectors
  for (int k = 0; k < 2; ++k) {
    twos[k] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * k], pairs[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm256_shuffle_ps(pairs[2 * k], pairs[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(twos[0], twos[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(twos[0], twos[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // sums = [x0, x2, x4, x6, x1, x3, x5, x7]
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The AVX2 build's two 8-lane accumulators of q . key, added: lanes 0-7 and 8-15 of one register.
template <int LANES>
inline __m256 dot_lanes(const __m512* query, const __m512* key) {
  __m512 v = _mm512_mul_ps(query[0], key[0]);
  for (int l = 1; l < LANES; ++l) v = _mm512_fmadd_ps(query[l], key[l], v);
  return _mm256_add_ps(_mm512_castps512_ps256(v), high_half(v));
}

// HEADS query heads of one row sharing a kv head, hd = 16 LANES (compile-time, so that the accumulators
// stay in registers): q of head g at q + g * q_stride, out likewise; scores: [HEADS][stride] scratch (stride >=
// count + 16). Each key and value is widened into registers once and used there by every head (a first version
// stored the widened keys and loaded them again for each head: 20-30 % slower, the same bits).
template <int LANES, int HEADS, typename Entry>
void attend_group(const float* q, int64_t q_stride, const Entry* keys, const Entry* values, const int64_t* slots,
                  int64_t count, float scale, float* scores, int64_t stride, float* out) {
  static_assert(HEADS * LANES <= MAX_GROUP_LANES, "too many accumulators");
  constexpr int64_t lanes = LANES, heads = HEADS, hd = 16 * LANES;
  __m512 query[MAX_GROUP_LANES];
  __m256 top[MAX_GROUP_LANES];
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t l = 0; l < lanes; ++l) query[g * lanes + l] = _mm512_loadu_ps(q + g * q_stride + 16 * l);
    top[g] = _mm256_set1_ps(-INFINITY);
  }
  const __m256 scale8 = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + KEYS_PER_SUM <= count; j += KEYS_PER_SUM) {
    __m256 dots[HEADS][KEYS_PER_SUM];
    for (int64_t k = 0; k < KEYS_PER_SUM; ++k) {  // each key widened into registers once, for every head
      const Entry* key = keys + slots[j + k] * hd;
      __m512 widened_key[LANES];
      for (int64_t l = 0; l < lanes; ++l) widened_key[l] = load16(key + 16 * l);
      for (int64_t g = 0; g < heads; ++g) dots[g][k] = dot_lanes<LANES>(query + g * lanes, widened_key);
    }
    for (int64_t g = 0; g < heads; ++g) {
      const __m256 block = _mm256_mul_ps(sum8(dots[g]), scale8);
      _mm256_storeu_ps(scores + g * stride + j, block);
      top[g] = _mm256_max_ps(top[g], block);
    }
  }
  for (; j < count; ++j) {
    const Entry* key = keys + slots[j] * hd;
    __m512 widened_key[LANES];
    for (int64_t l = 0; l < lanes; ++l) widened_key[l] = load16(key + 16 * l);
    for (int64_t g = 0; g < heads; ++g) {
      const float score = horizontal_sum(dot_lanes<LANES>(query + g * lanes, widened_key)) * scale;
      scores[g * stride + j] = score;
      top[g] = _mm256_max_ps(top[g], _mm256_set1_ps(score));
    }
  }
  // exponentials in blocks of 16, their sums in 8 lanes block by block of 8 as in the AVX2 build
  // (past the last score: -inf, whose exponential is an exact zero)
  const int64_t padded = (count + 15) / 16 * 16;
  float inverse[MAX_GROUP_LANES];
  for (int64_t g = 0; g < heads; ++g) {
    float* row = scores + g * stride;
    for (int64_t i = count; i < padded; ++i) row[i] = -INFINITY;
    alignas(32) float tops[8];
    _mm256_store_ps(tops, top[g]);
    float most = tops[0];
    for (int i = 1; i < 8; ++i) most = tops[i] > most ? tops[i] : most;
    const __m512 shift = _mm512_set1_ps(most);
    __m256 sums = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + i), shift));
      _mm512_storeu_ps(row + i, e);
      sums = _mm256_add_ps(_mm256_add_ps(sums, _mm512_castps512_ps256(e)), high_half(e));
    }
    inverse[g] = 1.0f / horizontal_sum(sums);
  }
  __m512 acc[MAX_GROUP_LANES];
  for (int64_t i = 0; i < heads * lanes; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const Entry* value = values + slots[i] * hd;
    __m512 v[8];
    for (int64_t l = 0; l < lanes; ++l) v[l] = load16(value + 16 * l);
    for (int64_t g = 0; g < heads; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * stride + i]);
      for (int64_t l = 0; l < lanes; ++l) acc[g * lanes + l] = _mm512_fmadd_ps(w, v[l], acc[g * lanes + l]);
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const __m512 factor = _mm512_set1_ps(inverse[g]);
    for (int64_t l = 0; l < lanes; ++l) {
      _mm512_storeu_ps(out + g * q_stride + 16 * l, _mm512_mul_ps(acc[g * lanes + l], factor));
    }
  }
}

// attend_group for `heads` (1 .. MAX_CHUNK) heads of hd = 16, 32, 64 or 128 (hd * heads <= 16 * MAX_GROUP_LANES).
template <int LANES, typename Entry>
void attend_chunk(int64_t heads, const float* q, int64_t q_stride, const Entry* keys, const Entry* values,
                  const int64_t* slots, int64_t count, float scale, float* scores, int64_t stride,
                  float* out) {
  switch (heads) {
    case 1: return attend_group<LANES, 1>(q, q_stride, keys, values, slots, count, scale, scores, stride, out);
    case 2: return attend_group<LANES, 2>(q, q_stride, keys, values, slots, count, scale, scores, stride, out);
    case 3:
      if constexpr (3 * LANES <= MAX_GROUP_LANES) {
        return attend_group<LANES, 3>(q, q_stride, keys, values, slots, count, scale, scores, stride, out);
      }
      break;
    case 4:
      if constexpr (4 * LANES <= MAX_GROUP_LANES) {
        return attend_group<LANES, 4>(q, q_stride, keys, values, slots, count, scale, scores, stride, out);
      }
      break;
  }
  TORCH_CHECK(false, "attend: unsupported head chunk");
}

template <typename Entry>
void attend_heads(int64_t hd, int64_t heads, const float* q, int64_t q_stride, const Entry* keys, const Entry* values,
                  const int64_t* slots, int64_t count, float scale, float* scores, int64_t stride,
                  float* out) {
  switch (hd) {
    case 16: return attend_chunk<1>(heads, q, q_stride, keys, values, slots, count, scale, scores, stride, out);
    case 32: return attend_chunk<2>(heads, q, q_stride, keys, values, slots, count, scale, scores, stride, out);
    case 64: return attend_chunk<4>(heads, q, q_stride, keys, values, slots, count, scale, scores, stride, out);
    case 128: return attend_chunk<8>(heads, q, q_stride, keys, values, slots, count, scale, scores, stride, out);
  }
  for (int64_t g = 0; g < heads; ++g) {  // other head sizes: the AVX2 build's task per head
    attend_row(q + g * q_stride, keys, values, slots, count, hd, scale, scores, out + g * q_stride);
  }
}
#endif

#ifdef __AMX_BF16__
// The AMX build (compiled where __AMX_BF16__ is defined) for bf16 caches of hd = 64: another arithmetic, the
// same for every row, pass, batch and thread count. A task is a kv head and up to 16 / group rows: its queries
// (rows x the heads sharing the kv head, at most 16) are the columns of one tile. Per row and head:
//   s_j = (bf16(q) . k_j) * scale, the products of bf16 pairs summed by TDPBF16PS over dims 0-31 and then 32-63
//     into a zeroed fp32 tile, keys in tiles of 16 from slot 0;
//   m = max s_j; e_j = bf16(exp(s_j - m)) (exp_nonpositive16; rounded to bf16, nearest even); z = sum_j e_j in
//     slot order, fp32;
//   out = (sum_j e_j v_j) / z, TDPBF16PS over keys in tiles of 32 from slot 0, each tile added to the fp32 totals.
// A tile's element depends on its row of A and column of B alone (not on its position in the tile nor on the
// other rows: checked on this instruction, and by tests/test_attention_kernel.py through the kernel), so a row's
// bits are those of its one-row pass. The slots the task's rows share with its first row (a tree's prefix: whole
// tiles of 32) are computed once for all of them; each row's other slots (its ancestors in the tree, the end of
// its prefix) are gathered into tiles of its own, where the other rows' weights are zero (adding a zero tile
// leaves a total as it is). Against the fp32 arithmetic it rounds q and the weights to bf16, as transformers'
// bf16 attention does.
namespace amx {

constexpr int64_t HD = 64;
constexpr int64_t QUERIES = 16;  // queries of a task: the columns of a score tile, the rows of a weight tile
constexpr int64_t KEYS = 16;     // keys of a score tile
constexpr int64_t CHUNK = 32;    // keys of a value tile (16 pairs)

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

inline void configure() {  // eight tiles of 16 rows x 64 bytes, on this thread
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

struct Row {
  const float* q;  // head g of the task's kv head at q + g * q_stride
  float* out;
  const int64_t* slots;
  int64_t count;
  int64_t shared;  // first slots shared with the task's first row (a multiple of CHUNK)
};

struct Scratch {
  uint16_t* queries;   // [2][16][16][2]: q^T as B tiles (dims 0-31, 32-63; pair rows x queries)
  uint16_t* keys;      // [KEYS][HD] gathered keys
  float* tile;         // [16][16] one score tile
  float* scores;       // [QUERIES][stride] scores (times scale)
  uint16_t* weights;   // [QUERIES][stride] the weights e_j, bf16 (a value tile's A: 32 columns, row stride `stride`)
  int64_t stride;      // >= a row's count rounded up to CHUNK, a multiple of 32
  uint16_t* partial;   // [QUERIES][CHUNK] an A tile of some queries' weights (the others zero)
  uint16_t* values;    // [4][16][16][2] a value tile's values (B, a tile per 16 dims; 64-byte aligned)
  uint16_t* gathered;  // [CHUNK][HD] gathered values
  float* totals;       // [4][QUERIES][16]
};

// 32 bf16 of x (dims 0-15) and y (16-31) word by word: (x0, y0, x1, y1, ...), for B tiles of value pairs
inline __m512i interleave_words(__m256i x, __m256i y) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), both);
}

// a 16 x 16 fp32 matrix in 16 registers, transposed in place
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

// scores of the 16 keys at `keys` (rows of HD) for queries [from, to), times scale, into their rows at `first`
inline void score_tile(const c10::BFloat16* keys, const Scratch& scratch, int64_t first, int64_t from, int64_t to,
                       float scale) {
  _tile_zero(0);
  _tile_loadd(1, keys, HD * 2);
  _tile_loadd(2, keys + 32, HD * 2);
  _tile_dpbf16ps(0, 1, 3);
  _tile_dpbf16ps(0, 2, 4);
  _tile_stored(0, scratch.tile, 64);  // [key][query]
  __m512 rows[16];
  for (int k = 0; k < 16; ++k) rows[k] = _mm512_loadu_ps(scratch.tile + 16 * k);
  transpose16(rows);  // [query][key]
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t n = from; n < to; ++n) {
    _mm512_storeu_ps(scratch.scores + n * scratch.stride + first, _mm512_mul_ps(rows[n], scale16));
  }
}

// add a tile of 32 keys' values (rows of HD at `values`) weighted by the A tile at `weights` (row stride in
// bytes) to the totals (tiles 4-7, 16 dims each)
inline void add_value_tile(const c10::BFloat16* values, const uint16_t* weights, int64_t weight_stride,
                           const Scratch& scratch) {
  const uint16_t* base = reinterpret_cast<const uint16_t*>(values);
  for (int64_t r = 0; r < 16; ++r) {
    const uint16_t* first = base + 2 * r * HD;
    for (int64_t c = 0; c < 4; ++c) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 16 * c));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + HD + 16 * c));
      _mm512_store_si512(scratch.values + (c * 16 + r) * 32, interleave_words(x, y));
    }
  }
  _tile_loadd(0, weights, weight_stride);
  _tile_loadd(1, scratch.values, 64);
  _tile_dpbf16ps(4, 0, 1);
  _tile_loadd(1, scratch.values + 16 * 32, 64);
  _tile_dpbf16ps(5, 0, 1);
  _tile_loadd(1, scratch.values + 32 * 32, 64);
  _tile_dpbf16ps(6, 0, 1);
  _tile_loadd(1, scratch.values + 48 * 32, 64);
  _tile_dpbf16ps(7, 0, 1);
}

// an A tile of the weights of keys first .. first + CHUNK for the queries `takes` marks (the others zero)
inline const uint16_t* partial_weights(const Scratch& scratch, int64_t first, const bool* takes) {
  for (int64_t n = 0; n < QUERIES; ++n) {
    if (takes[n]) {
      std::memcpy(scratch.partial + n * CHUNK, scratch.weights + n * scratch.stride + first, CHUNK * 2);
    } else {
      std::memset(scratch.partial + n * CHUNK, 0, CHUNK * 2);
    }
  }
  return scratch.partial;
}

inline void gather(const c10::BFloat16* entries, const int64_t* slots, int64_t from, int64_t count, int64_t size,
                   uint16_t* into) {
  for (int64_t k = 0; k < size; ++k) {
    if (from + k < count) {
      std::memcpy(into + k * HD, entries + slots[from + k] * HD, HD * 2);
    } else {
      std::memset(into + k * HD, 0, HD * 2);
    }
  }
}

inline bool contiguous(const int64_t* slots, int64_t from, int64_t size) {
  return slots[from + size - 1] - slots[from] == size - 1;
}

void attend_task(const Row* rows, int64_t count_rows, int64_t group, int64_t q_stride, const c10::BFloat16* keys,
                 const c10::BFloat16* values, float scale, const Scratch& scratch) {
  const int64_t queries = count_rows * group;
  // q^T in B tiles: pair row r of half h holds dims 32 h + 2 r, + 1 of each query
  std::memset(scratch.queries, 0, 2 * 16 * 32 * 2);
  for (int64_t n = 0; n < queries; ++n) {
    const float* q = rows[n / group].q + (n % group) * q_stride;
    for (int64_t h = 0; h < 2; ++h) {
      alignas(64) uint32_t pairs[16];
      const __m512bh rounded = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * h + 16), _mm512_loadu_ps(q + 32 * h));
      _mm512_store_si512(pairs, (__m512i)rounded);
      uint32_t* half = reinterpret_cast<uint32_t*>(scratch.queries) + h * 16 * 16;
      for (int64_t r = 0; r < 16; ++r) half[r * 16 + n] = pairs[r];
    }
  }
  _tile_loadd(3, scratch.queries, 64);
  _tile_loadd(4, scratch.queries + 16 * 32, 64);
  int64_t shared = 0;
  for (int64_t i = 0; i < count_rows; ++i) shared = std::max(shared, rows[i].shared);
  // scores: the shared slots for every query, then each row's own
  for (int64_t first = 0; first < shared; first += KEYS) {
    const c10::BFloat16* at = keys + rows[0].slots[first] * HD;
    if (!contiguous(rows[0].slots, first, KEYS)) {
      gather(keys, rows[0].slots, first, first + KEYS, KEYS, scratch.keys);
      at = reinterpret_cast<const c10::BFloat16*>(scratch.keys);
    }
    score_tile(at, scratch, first, 0, queries, scale);
  }
  for (int64_t i = 0; i < count_rows; ++i) {
    const Row& row = rows[i];
    for (int64_t first = row.shared; first < row.count; first += KEYS) {
      gather(keys, row.slots, first, row.count, KEYS, scratch.keys);
      score_tile(reinterpret_cast<const c10::BFloat16*>(scratch.keys), scratch, first, i * group, (i + 1) * group,
                 scale);
    }
  }
  // softmax per query, lanes = keys: -inf past the row's count up to a whole value tile (weights 0 there)
  alignas(64) float inverse[QUERIES];
  for (int64_t n = 0; n < queries; ++n) {
    const int64_t count = rows[n / group].count, span = (count + CHUNK - 1) / CHUNK * CHUNK;
    float* scores = scratch.scores + n * scratch.stride;
    uint16_t* weights = scratch.weights + n * scratch.stride;
    for (int64_t j = count; j < span; ++j) scores[j] = -INFINITY;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < span; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + j));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < span; j += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), shift));
      const __m256i words = (__m256i)_mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + j), words);
      sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16)));
    }
    inverse[n] = 1.0f / _mm512_reduce_add_ps(sums);
  }
  // values: the shared tiles for every query that shares them, then each row's own
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  bool takes[QUERIES];
  for (int64_t first = 0; first < shared; first += CHUNK) {
    bool all = true;
    for (int64_t n = 0; n < QUERIES; ++n) {
      takes[n] = n < queries && rows[n / group].shared > first;
      all = all && (takes[n] || n >= queries);
    }
    const uint16_t* weights = all ? scratch.weights + first : partial_weights(scratch, first, takes);
    const int64_t weight_stride = all ? scratch.stride * 2 : CHUNK * 2;
    const c10::BFloat16* at = values + rows[0].slots[first] * HD;
    if (!contiguous(rows[0].slots, first, CHUNK)) {
      gather(values, rows[0].slots, first, first + CHUNK, CHUNK, scratch.gathered);
      at = reinterpret_cast<const c10::BFloat16*>(scratch.gathered);
    }
    add_value_tile(at, weights, weight_stride, scratch);
  }
  for (int64_t i = 0; i < count_rows; ++i) {
    const Row& row = rows[i];
    for (int64_t n = 0; n < QUERIES; ++n) takes[n] = n / group == i && n < queries;
    for (int64_t first = row.shared; first < row.count; first += CHUNK) {
      gather(values, row.slots, first, row.count, CHUNK, scratch.gathered);
      add_value_tile(reinterpret_cast<const c10::BFloat16*>(scratch.gathered), partial_weights(scratch, first, takes),
                     CHUNK * 2, scratch);
    }
  }
  _tile_stored(4, scratch.totals, 64);
  _tile_stored(5, scratch.totals + 256, 64);
  _tile_stored(6, scratch.totals + 512, 64);
  _tile_stored(7, scratch.totals + 768, 64);
  for (int64_t n = 0; n < queries; ++n) {
    float* out = rows[n / group].out + (n % group) * q_stride;
    const __m512 factor = _mm512_set1_ps(inverse[n]);
    for (int64_t c = 0; c < 4; ++c) {
      _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(scratch.totals + c * 256 + n * 16), factor));
    }
  }
}

}  // namespace amx
#endif

// The slots row r of sequence s sees, in position order, into `slots`; their count.
inline int64_t row_slots(const bool* row_seen, const int64_t* row_tail, int64_t head, int64_t tail, int64_t* slots) {
  int64_t count = 0;
  for (int64_t j = 0; j < head; ++j) {
    if (row_seen[j]) slots[count++] = j;
  }
  for (int64_t t = 0; t < tail; ++t) {
    if (row_seen[head + t]) slots[count++] = row_tail[t];
  }
  return count;
}

// q [S, nh, n, hd] fp32; keys, values [S, kvh, capacity, hd] fp32 or bf16; seen [S, n, T + B] bool;
// tail_slots [S, n, B] int64 -> [S, nh, n, hd] fp32.
at::Tensor attend_blocked_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& seen, const at::Tensor& tail_slots) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "attend: q must be [S, nh, n, hd] fp32");
  TORCH_CHECK(keys.dim() == 4 && (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16) &&
                  values.sizes() == keys.sizes() && values.scalar_type() == keys.scalar_type(),
              "attend: keys and values must be [S, kvh, capacity, hd], both fp32 or both bf16");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == keys.size(3) && values.stride(3) == 1 &&
                  values.stride(2) == values.size(3),
              "attend: each head's cache must be dense");
  TORCH_CHECK(seen.scalar_type() == at::kBool && seen.is_contiguous() && tail_slots.scalar_type() == at::kLong &&
                  tail_slots.is_contiguous(),
              "attend: bad layout");
  const int64_t sequences = q.size(0), heads = q.size(1), n = q.size(2), hd = q.size(3);
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2), tail = tail_slots.size(2);
  const int64_t width = seen.size(2), head = width - tail;
  TORCH_CHECK(hd % 16 == 0 && hd <= 128 && keys.size(3) == hd && heads % kv_heads == 0, "attend: unsupported head_dim");
  TORCH_CHECK(seen.size(0) == sequences && seen.size(1) == n && tail_slots.size(0) == sequences &&
                  tail_slots.size(1) == n && head >= 0 && head + tail <= capacity,
              "attend: the layout does not fit q and the cache");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* qs = q.data_ptr<float>();
  const bool* seen_data = seen.data_ptr<bool>();
  const int64_t* tail_data = tail_slots.data_ptr<int64_t>();
  float* result = out.data_ptr<float>();
  const bool half = keys.scalar_type() == at::kBFloat16;
#ifdef __AMX_BF16__
  if (half && hd == amx::HD && group <= amx::QUERIES) {
    TORCH_CHECK(amx::permitted(), "attend: this process may not use AMX tiles (CAUSALDRAFT_ATTENTION_KERNEL=avx512 "
                "picks the AVX-512 build)");
    const int64_t task_rows = amx::QUERIES / group;
    const int64_t blocks = (n + task_rows - 1) / task_rows;
    at::parallel_for(0, sequences * kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
      amx::configure();
      std::vector<int64_t> slots(task_rows * width);
      const int64_t stride = (width + 2 * amx::CHUNK) / 32 * 32;
      std::vector<uint16_t> queries(2 * 16 * 32), gathered_keys(amx::KEYS * amx::HD), weights(amx::QUERIES * stride);
      std::vector<uint16_t> partial(amx::QUERIES * amx::CHUNK), value_tiles(4 * 16 * 32 + 32);
      std::vector<uint16_t> gathered_values(amx::CHUNK * amx::HD);
      std::vector<float> scores(amx::QUERIES * stride), tile(16 * 16), totals(4 * 16 * 16);
      uint16_t* aligned_values =  // the value tiles are written with aligned stores
          reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(value_tiles.data()) + 63) & ~uintptr_t{63});
      const amx::Scratch scratch{queries.data(), gathered_keys.data(), tile.data(),   scores.data(),
                                 weights.data(), stride,               partial.data(), aligned_values,
                                 gathered_values.data(), totals.data()};
      std::vector<amx::Row> rows(task_rows);
      const c10::BFloat16* key_data = reinterpret_cast<const c10::BFloat16*>(keys.data_ptr<at::BFloat16>());
      const c10::BFloat16* value_data = reinterpret_cast<const c10::BFloat16*>(values.data_ptr<at::BFloat16>());
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / (kv_heads * blocks), kv = task / blocks % kv_heads, block = task % blocks;
        const int64_t first_row = block * task_rows, count_rows = std::min(task_rows, n - first_row);
        for (int64_t i = 0; i < count_rows; ++i) {
          const int64_t r = first_row + i;
          int64_t* own = slots.data() + i * width;
          const int64_t count = row_slots(seen_data + (s * n + r) * width, tail_data + (s * n + r) * tail, head, tail, own);
          int64_t common = count;  // the first row's own count; another row's: the slots it shares with the first
          if (i > 0) {
            const int64_t most = std::min(count, rows[0].count);
            common = 0;
            while (common < most && own[common] == rows[0].slots[common]) ++common;
          }
          const int64_t at = ((s * heads + kv * group) * n + r) * hd;
          rows[i] = amx::Row{qs + at, result + at, own, count, common / amx::CHUNK * amx::CHUNK};
        }
        amx::attend_task(rows.data(), count_rows, group, n * hd, key_data + s * keys.stride(0) + kv * keys.stride(1),
                         value_data + s * values.stride(0) + kv * values.stride(1), scale, scratch);
      }
      _tile_release();
    });
    return out;
  }
#endif
#ifdef __AVX512F__
  const int64_t chunk = std::min({group, MAX_CHUNK, MAX_GROUP_LANES / (hd / 16)});  // heads per attend_group call
  at::parallel_for(0, sequences * kv_heads * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(width);
    const int64_t stride = width + 16;
    std::vector<float> scores(chunk * stride);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (kv_heads * n), kv = task / n % kv_heads, r = task % n;
      const int64_t count = row_slots(seen_data + (s * n + r) * width, tail_data + (s * n + r) * tail, head, tail,
                                      slots.data());
      const int64_t key_at = s * keys.stride(0) + kv * keys.stride(1);
      const int64_t value_at = s * values.stride(0) + kv * values.stride(1);
      for (int64_t first = kv * group; first < (kv + 1) * group; first += chunk) {
        const int64_t count_heads = std::min(chunk, (kv + 1) * group - first);
        const int64_t at = ((s * heads + first) * n + r) * hd;
        if (half) {
          attend_heads(hd, count_heads, qs + at, n * hd, keys.data_ptr<at::BFloat16>() + key_at,
                       values.data_ptr<at::BFloat16>() + value_at, slots.data(), count, scale, scores.data(), stride,
                       result + at);
        } else {
          attend_heads(hd, count_heads, qs + at, n * hd, keys.data_ptr<float>() + key_at,
                       values.data_ptr<float>() + value_at, slots.data(), count, scale, scores.data(), stride,
                       result + at);
        }
      }
    }
  });
#else
  at::parallel_for(0, sequences * heads * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(width);
    std::vector<float> scores(width + 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (heads * n), h = task / n % heads, r = task % n;
      const int64_t count = row_slots(seen_data + (s * n + r) * width, tail_data + (s * n + r) * tail, head, tail,
                                      slots.data());
      const int64_t kv = h / group;
      const int64_t key_at = s * keys.stride(0) + kv * keys.stride(1);
      const int64_t value_at = s * values.stride(0) + kv * values.stride(1);
      const float* query = qs + ((s * heads + h) * n + r) * hd;
      float* row_out = result + ((s * heads + h) * n + r) * hd;
      if (half) {
        attend_row(query, keys.data_ptr<at::BFloat16>() + key_at, values.data_ptr<at::BFloat16>() + value_at,
                   slots.data(), count, hd, scale, scores.data(), row_out);
      } else {
        attend_row(query, keys.data_ptr<float>() + key_at, values.data_ptr<float>() + value_at, slots.data(), count,
                   hd, scale, scores.data(), row_out);
      }
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(causaldraft, m) {
  m.def("attend_blocked(Tensor q, Tensor keys, Tensor values, Tensor seen, Tensor tail_slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(causaldraft, CPU, m) { m.impl("attend_blocked", &attend_blocked_rows); }
