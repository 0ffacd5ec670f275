// Group-wise int4 linear layer on the CPU: y = x W^T with W = q * scale + offset per group of inputs (q in 0..15; a
// GGUF's Q4_0 is scale d, offset -8 d, its Q4_1 scale d, offset m, all exact in the fp16 pairs stored here).
//
// Each row of x is quantized per block of 32 inputs to two int8 digits, x ~= d / 256 * (256 a + a2): a = round(x / d)
// with d = max|x| / 127, and a2 the rounded remainder in steps of d / 256. That is about 16 bits a value (the
// remainder is at most d / 512), finer than bf16 for all but a block's tiny values. A block's dot product with the
// int4 codes, 256 dot(q, a) + dot(q, a2), is an exact integer below 2^24 (VNNI dpbusd, AVX2 maddubs, or plain C++:
// the same integer), then folded into a float accumulator in a fixed order:
//   y += (d / 256) * (scale_g * dot + offset_g * sum(256 a + a2)).
// A row's result therefore depends on that row alone, never on the batch it is in or how the work is split.
//
// Weight layout (`pack_int4_tiles` in mlc/layers/quant_kernels.py): uint8 [N/16, K/group, group * 8 + 64], one
// stream per tile of 16 output columns, group after group. A group is group/8 chunks of 64 bytes, then its 16 columns'
// (scale, offset) fp16 pairs. In a chunk of 8 inputs, byte 4 * j + i holds column j's input i in its low nibble and
// input 4 + i in its high nibble.
#include "ops.h"
#include "quant_gemm.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace mlc;

// The float fold of one block for one output column, shared by every path so they agree bit for bit.
inline float fold(float acc, int32_t dot, float s, float o, float d, float asum) {
  return std::fma(std::fma(static_cast<float>(dot), s, o * asum), d, acc);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// 8 uint32 lanes holding a value below 2^16 each -> those 8 values as uint16, in order (for F16C's cvtph)
inline __m128i halves(__m256i v) {
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}
#endif

// Rows [m0, m0 + R) against one tile of 16 columns (`w`, the tile's packed groups), written as float to
// y[r * ldy + column].
template <int R>
void tile_rows(const Quantized& a, int64_t m0, const uint8_t* w, int64_t K, int64_t ldy, int64_t group, float* y) {
  const int64_t blocks = K / kBlock, per_group = group / kBlock, group_bytes = group * 8 + 64;
  // block b's chunk c of 8 inputs, and the scale/zero pairs of the group holding block b
  auto chunk = [&](int64_t b, int64_t c) { return w + (b / per_group) * group_bytes + (b % per_group) * 256 + c * 64; };
  auto pairs = [&](int64_t b) {
    return reinterpret_cast<const uint32_t*>(w + (b / per_group) * group_bytes + group * 8);
  };
  // the 4 + 4 activation codes (both digits) that meet chunk c of block b in row r
  auto codes = [&](const int8_t* base, int r, int64_t b, int64_t c, int half) {
    int32_t v;
    std::memcpy(&v, base + (m0 + r) * K + b * kBlock + c * 8 + 4 * half, 4);
    return v;
  };
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    // integer sums are exact in any order: one accumulator per digit and nibble keeps the dpbusd chains short
    __m512i part[R][4];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < 4; ++p) part[r][p] = _mm512_setzero_si512();
    for (int64_t c = 0; c < kBlock / 8; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(chunk(b, c)) + kPrefetch, _MM_HINT_T0);
      const __m512i packed = _mm512_loadu_si512(chunk(b, c));
      const __m512i nibbles[2] = {_mm512_and_si512(packed, nib), _mm512_and_si512(_mm512_srli_epi16(packed, 4), nib)};
      for (int r = 0; r < R; ++r) {
        for (int h = 0; h < 2; ++h) {
          part[r][h] = _mm512_dpbusd_epi32(part[r][h], nibbles[h], _mm512_set1_epi32(codes(a.codes, r, b, c, h)));
          part[r][2 + h] = _mm512_dpbusd_epi32(part[r][2 + h], nibbles[h], _mm512_set1_epi32(codes(a.low, r, b, c, h)));
        }
      }
    }
    const __m512i pair = _mm512_loadu_si512(pairs(b));
    const __m512 s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pair));  // low halves: the scales
    const __m512 o = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));  // high: the offsets
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(part[r][0], part[r][1]), 8),
                                           _mm512_add_epi32(part[r][2], part[r][3]));
      const int64_t at = (m0 + r) * blocks + b;
      const __m512 u = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, _mm512_mul_ps(o, _mm512_set1_ps(a.sum[at])));
      acc[r] = _mm512_fmadd_ps(u, _mm512_set1_ps(a.scale[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  // u8 x s8 pairs summed to int16 (at most 2 * 15 * 127, no saturation), then pairs of those to int32
  auto dot4 = [&](__m256i w4, int32_t a4) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w4, _mm256_set1_epi32(a4)), ones);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i high[R][2], low[R][2];  // per digit, per 8 columns
    for (int r = 0; r < R; ++r) high[r][0] = high[r][1] = low[r][0] = low[r][1] = _mm256_setzero_si256();
    for (int64_t c = 0; c < kBlock / 8; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(chunk(b, c)) + kPrefetch, _MM_HINT_T0);
      for (int half = 0; half < 2; ++half) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk(b, c) + half * 32));
        const __m256i nibbles[2] = {_mm256_and_si256(packed, nib), _mm256_and_si256(_mm256_srli_epi16(packed, 4), nib)};
        for (int r = 0; r < R; ++r) {
          for (int h = 0; h < 2; ++h) {
            high[r][half] = _mm256_add_epi32(high[r][half], dot4(nibbles[h], codes(a.codes, r, b, c, h)));
            low[r][half] = _mm256_add_epi32(low[r][half], dot4(nibbles[h], codes(a.low, r, b, c, h)));
          }
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs(b) + half * 8));
      const __m256 s = _mm256_cvtph_ps(halves(_mm256_and_si256(pair, lo16)));
      const __m256 o = _mm256_cvtph_ps(halves(_mm256_srli_epi32(pair, 16)));
      for (int r = 0; r < R; ++r) {
        const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(high[r][half], 8), low[r][half]);
        const int64_t at = (m0 + r) * blocks + b;
        const __m256 u = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, _mm256_mul_ps(o, _mm256_set1_ps(a.sum[at])));
        acc[r][half] = _mm256_fmadd_ps(u, _mm256_set1_ps(a.scale[at]), acc[r][half]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kCols; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t high = 0, low = 0;
        for (int64_t c = 0; c < kBlock / 8; ++c) {
          const uint8_t* wb = chunk(b, c) + 4 * j;
          const int8_t* ar = a.codes + (m0 + r) * K + b * kBlock + c * 8;
          const int8_t* lr = a.low + (m0 + r) * K + b * kBlock + c * 8;
          for (int i = 0; i < 4; ++i) {
            high += (wb[i] & 0x0F) * ar[i] + (wb[i] >> 4) * ar[4 + i];
            low += (wb[i] & 0x0F) * lr[i] + (wb[i] >> 4) * lr[4 + i];
          }
        }
        const uint32_t pair = pairs(b)[j];
        const int64_t at = (m0 + r) * blocks + b;
        acc = fold(acc, 256 * high + low, fp16_bits_to_float(static_cast<uint16_t>(pair & 0xFFFFu)),
                   fp16_bits_to_float(static_cast<uint16_t>(pair >> 16)), a.scale[at], a.sum[at]);
      }
      y[r * ldy + j] = acc;
    }
  }
#endif
}

}  // namespace

namespace mlc {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t group) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(group > 0 && group % kBlock == 0, "the group size must be a multiple of 32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == group * 8 + 64 && packed.scalar_type() == at::kByte,
              "packed weights must be uint8 [N/16, K/group, group * 8 + 64]");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.size(1) * group == K, "packed weights cover ", packed.size(1) * group, " inputs, x has ", K);
  auto wc = packed.contiguous();
  return quantized_gemm(x, wc.data_ptr<uint8_t>(), packed.size(0) * kCols, packed.size(1) * packed.size(2),
                        [&](auto rows, auto, const Quantized& a, int64_t m, const uint8_t* w, float* out) {
                          tile_rows<decltype(rows)::value>(a, m, w, K, kCols, group, out);
                        });
}

}  // namespace mlc
