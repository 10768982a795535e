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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
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
  const int64_t tasks = sequences * heads * n;
  const bool half = keys.scalar_type() == at::kBFloat16;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(width);
    std::vector<float> scores(width + 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (heads * n), h = task / n % heads, r = task % n;
      const bool* row_seen = seen_data + (s * n + r) * width;
      const int64_t* row_tail = tail_data + (s * n + r) * tail;
      int64_t count = 0;
      for (int64_t j = 0; j < head; ++j) {
        if (row_seen[j]) slots[count++] = j;
      }
      for (int64_t t = 0; t < tail; ++t) {
        if (row_seen[head + t]) slots[count++] = row_tail[t];
      }
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
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(causaldraft, m) {
  m.def("attend_blocked(Tensor q, Tensor keys, Tensor values, Tensor seen, Tensor tail_slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(causaldraft, CPU, m) { m.impl("attend_blocked", &attend_blocked_rows); }
