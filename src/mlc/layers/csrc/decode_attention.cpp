// Decode attention over the paged KV cache: one new query token per sequence, its context read in place through
// the page table (no gather, no padding, no mask). Each (sequence, KV head) is computed whole by one thread in a
// fixed order, so a sequence's result is the same bit for bit alone or in any batch. Float accumulation; the
// query, cache and output share one dtype (float, bfloat16 or half). Registered in ops.cpp; built at run time by
// mlc/layers/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += q[i + j] * static_cast<float>(k[i + j]);
  }
  for (int w = 8; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  float s = acc[0];
  for (; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

#ifdef __AVX512F__
#include <immintrin.h>
#define MLC_AVX512 1

template <typename T>
inline __m512 load16(const T* p) {  // double: converted one by one
  alignas(64) float t[16];
  for (int i = 0; i < 16; ++i) t[i] = static_cast<float>(p[i]);
  return _mm512_load_ps(t);
}
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#else
#define MLC_AVX512 0
#endif

#if MLC_AVX512
// Visit the context's rows in order, page by page (no division a row): f(j, row index in the cache).
template <typename F>
inline void each_slot(const int64_t* table, int64_t page_size, int64_t L, F f) {
  for (int64_t j0 = 0, p = 0; j0 < L; j0 += page_size, ++p) {
    const int64_t base = table[p] * page_size, n = std::min(page_size, L - j0);
    for (int64_t j = 0; j < n; ++j) f(j0 + j, base + j);
  }
}

// One (sequence, KV head): its G query heads' scores, softmax and weighted values, four heads a pass with their sums
// in registers. Every score and every output element is the same chain of operations as the scalar loop's vector
// twin had (fma over D in 16-lane steps then one lane reduction; fma over the rows in order), so the bits do not
// depend on how heads are grouped.
template <typename T>
void job_avx512(const float* qf, const T* kp, const T* vp, const int64_t* table, int64_t page_size, int64_t KV,
                int64_t h, int64_t G, int64_t D, int64_t Dv, int64_t L, float scale, float* scores, float* acc,
                float* total) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    each_slot(table, page_size, L, [&](int64_t j, int64_t slot) {
      const T* krow = kp + (slot * KV + h) * D;
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t i = 0; i < D; i += 16) {
        const __m512 kv = load16(krow + i);
        for (int64_t g = 0; g < gn; ++g) a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + (g0 + g) * D + i), kv, a[g]);
      }
      for (int64_t g = 0; g < gn; ++g) scores[(g0 + g) * L + j] = _mm512_reduce_add_ps(a[g]) * scale;
    });
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * L;
    __m512 mv = _mm512_set1_ps(s[0]);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    float m = _mm512_reduce_max_ps(mv);  // max is exact: the same value in any order
    for (; j < L; ++j) m = std::max(m, s[j]);
    j = 0;
    for (; j + 16 <= L; j += 16) _mm512_storeu_ps(s + j, mlc::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(m))));
    for (; j < L; ++j) s[j] = mlc::exp_nonpositive(s[j] - m);
    total[g] = mlc::lane_sum(s, L);
  }
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    for (int64_t i0 = 0; i0 < Dv; i0 += 64) {
      const int64_t cn = std::min<int64_t>(4, (Dv - i0) / 16);
      __m512 a[4][4];
      for (auto& row : a)
        for (auto& x : row) x = _mm512_setzero_ps();
      each_slot(table, page_size, L, [&](int64_t j, int64_t slot) {
        const T* vrow = vp + (slot * KV + h) * Dv + i0;
        for (int64_t c = 0; c < cn; ++c) {
          const __m512 vv = load16(vrow + 16 * c);
          for (int64_t g = 0; g < gn; ++g)
            a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(g0 + g) * L + j]), vv, a[g][c]);
        }
      });
      for (int64_t g = 0; g < gn; ++g)
        for (int64_t c = 0; c < cn; ++c) _mm512_storeu_ps(acc + (g0 + g) * Dv + i0 + 16 * c, a[g][c]);
    }
  }
}
#endif

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
            const at::Tensor& ctx, int64_t page_size, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k.size(1), Dv = v.size(2), P = pages.size(1);
  const int64_t G = H / KV;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* pp = pages.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, cp[b]);
  // small steps run on the calling thread: waking the pool costs more than the work
  const int64_t grain = std::max<int64_t>(1, 65536 / (longest * H * (D + Dv)));
  at::parallel_for(0, B * KV, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(G * D), acc(G * Dv), total(G);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / KV, h = job % KV, L = cp[b];
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + (b * H + h * G + g) * D;
        for (int64_t i = 0; i < D; ++i) qf[g * D + i] = static_cast<float>(qrow[i]);
      }
      const int64_t* table = pp + b * P;
#if MLC_AVX512
      if (D % 16 == 0 && Dv % 16 == 0) {
        job_avx512(qf.data(), kp, vp, table, page_size, KV, h, G, D, Dv, L, static_cast<float>(scale), scores.data(),
                   acc.data(), total.data());
      } else
#endif
      {
        for (int64_t j = 0; j < L; ++j) {
          const int64_t slot = table[j / page_size] * page_size + j % page_size;
          const T* krow = kp + (slot * KV + h) * D;
          for (int64_t g = 0; g < G; ++g) scores[g * L + j] = dot(&qf[g * D], krow, D) * static_cast<float>(scale);
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = &scores[g * L];
          float m = s[0];
          for (int64_t j = 1; j < L; ++j) m = std::max(m, s[j]);
          int64_t j = 0;
#if MLC_AVX512
          for (; j + 16 <= L; j += 16)
            _mm512_storeu_ps(s + j, mlc::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(m))));
#endif
          for (; j < L; ++j) s[j] = mlc::exp_nonpositive(s[j] - m);
          total[g] = mlc::lane_sum(s, L);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < L; ++j) {
          const int64_t slot = table[j / page_size] * page_size + j % page_size;
          const T* vrow = vp + (slot * KV + h) * Dv;
          for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * L + j];
            float* a = &acc[g * Dv];
            for (int64_t i = 0; i < Dv; ++i) a[i] += w * static_cast<float>(vrow[i]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / total[g];
        T* orow = op + (b * H + h * G + g) * Dv;
        for (int64_t i = 0; i < Dv; ++i) orow[i] = static_cast<T>(acc[g * Dv + i] * inv);
      }
    }
  });
}

}  // namespace

namespace mlc {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
                            const at::Tensor& ctx, int64_t page_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [B, H, D], k [S, KV, D], v [S, KV, Dv]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype for q, k, v");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2), "query heads must group over the KV heads");
  TORCH_CHECK(pages.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong, "int64 page table and lengths");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), pc = pages.contiguous(), cc = ctx.contiguous();
  auto out = at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode<scalar_t>(qc, kc, vc, pc, cc, page_size, scale, out);
  });
  return out;
}

}  // namespace mlc
