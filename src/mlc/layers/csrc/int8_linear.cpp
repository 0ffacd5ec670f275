// int8 linear layer on the CPU (W8A8 with about 16-bit activations): y = x W^T with W ~= q * scale per output row.
//
// Activations are the two int8 digits of quant_gemm.h. A block of 32 inputs gives one exact integer,
// sum q * (256 a + a2) (below 2^28), folded in float in a fixed order: y = scale * sum_b (d_b / 256) * dot_b. So a
// row's result depends on that row alone, whatever its batch, and every code path (VNNI, AVX2, plain C++) agrees.
//
// Weight layout (`pack_int8_tiles` in mlc/layers/quant_kernels.py): uint8 [N/16, K * 16 + 64], one stream per tile
// of 16 output rows: K/4 chunks of 64 bytes (byte 4 * j + i is row j's input i of the chunk, stored as q + 128), then
// the 16 rows' float scales.
#include "ops.h"
#include "quant_gemm.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace mlc;

template <int R>
void tile_rows(const Quantized& a, int64_t m0, const uint8_t* w, int64_t K, float* y) {
  const int64_t blocks = K / kBlock;
  auto codes = [&](const int8_t* base, int r, int64_t k) {  // 4 activation codes of row r from input k
    int32_t v;
    std::memcpy(&v, base + (m0 + r) * K + k, 4);
    return v;
  };
  const float* scales = reinterpret_cast<const float*>(w + K * kCols);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i high[R], low[R];
    for (int r = 0; r < R; ++r) high[r] = low[r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < kBlock / 4; ++c) {
      const uint8_t* p = w + (b * 8 + c) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(p);
      for (int r = 0; r < R; ++r) {
        high[r] = _mm512_dpbusd_epi32(high[r], wv, _mm512_set1_epi32(codes(a.codes, r, b * kBlock + c * 4)));
        low[r] = _mm512_dpbusd_epi32(low[r], wv, _mm512_set1_epi32(codes(a.low, r, b * kBlock + c * 4)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * blocks + b;
      // the weights are stored as q + 128 (dpbusd multiplies unsigned by signed): take 128 sum(256 a + a2) back
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(high[r], 8), low[r]),
                                           _mm512_set1_epi32(128 * static_cast<int32_t>(a.sum[at])));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(a.scale[at]), acc[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(scales);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * kCols, _mm512_mul_ps(acc[r], s));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  // |a| times q with a's sign, pairs to int16 (at most 2 * 127 * 127, no saturation), then to int32
  auto dot4 = [&](__m256i q, int32_t a4) {
    const __m256i av = _mm256_set1_epi32(a4);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(av), _mm256_sign_epi8(q, av)), ones);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i high[R][2], low[R][2];
    for (int r = 0; r < R; ++r) high[r][0] = high[r][1] = low[r][0] = low[r][1] = _mm256_setzero_si256();
    for (int64_t c = 0; c < kBlock / 4; ++c) {
      const uint8_t* p = w + (b * 8 + c) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
      for (int half = 0; half < 2; ++half) {
        const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + half * 32)), flip);
        for (int r = 0; r < R; ++r) {
          high[r][half] = _mm256_add_epi32(high[r][half], dot4(q, codes(a.codes, r, b * kBlock + c * 4)));
          low[r][half] = _mm256_add_epi32(low[r][half], dot4(q, codes(a.low, r, b * kBlock + c * 4)));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(a.scale[(m0 + r) * blocks + b]);
      for (int half = 0; half < 2; ++half) {
        const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(high[r][half], 8), low[r][half]);
        acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[r][half]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * kCols, _mm256_mul_ps(acc[r][0], _mm256_loadu_ps(scales)));
    _mm256_storeu_ps(y + r * kCols + 8, _mm256_mul_ps(acc[r][1], _mm256_loadu_ps(scales + 8)));
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kCols; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) {
          const int32_t q = static_cast<int32_t>(w[(b * 8 + i / 4) * 64 + 4 * j + i % 4]) - 128;
          const int64_t k = (m0 + r) * K + b * kBlock + i;
          dot += q * (256 * a.codes[k] + a.low[k]);
        }
        acc = std::fma(static_cast<float>(dot), a.scale[(m0 + r) * blocks + b], acc);
      }
      y[r * kCols + j] = acc * scales[j];
    }
  }
#endif
}

}  // namespace

namespace mlc {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, "packed weights must be uint8 [N/16, K*16+64]");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.size(1) == K * kCols + 64, "packed weights cover ", (packed.size(1) - 64) / kCols,
              " inputs, x has ", K);
  auto wc = packed.contiguous();
  return quantized_gemm(x, wc.data_ptr<uint8_t>(), packed.size(0) * kCols, packed.size(1),
                        [&](auto rows, auto, const Quantized& a, int64_t m, const uint8_t* w, float* out) {
                          tile_rows<decltype(rows)::value>(a, m, w, K, out);
                        });
}

}  // namespace mlc
