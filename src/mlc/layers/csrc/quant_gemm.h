// What the C++ quantized GEMMs share (int4_linear.cpp, int8_linear.cpp): the activations as two int8 digits per
// block of 32 inputs, and the driver that splits the output into tiles of 16 columns over the threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace mlc {

constexpr int64_t kBlock = 32;  // inputs per activation scale
constexpr int64_t kCols = 16;   // output columns per weight tile
constexpr int64_t kRows = 4;    // rows that share one pass over a weight tile
// Weights stream from memory once a token; the hardware prefetcher stops at each 4 KiB page, so each load asks for
// the line 4 KiB ahead (the next tiles of the same thread follow contiguously). About 1.3x at batch 1 here.
constexpr int64_t kPrefetch = 4096;

struct Quantized {  // the activations: both digits' int8 codes, and per block the scale d / 256 and sum(256 a + a2)
  const int8_t* codes;
  const int8_t* low;
  const float* scale;
  const float* sum;
  const int32_t* sum16;  // sum(256 a + a2) of each half block (16 inputs), two a block
};

inline float bf16_bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// An IEEE half as float: exact for every value (normal, subnormal, zero, inf, nan), so it agrees with the F16C and
// AVX-512 conversions bit for bit.
inline float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize the mantissa
    int shift = 0;
    uint32_t m = mant;
    while (!(m & 0x400u)) {
      m <<= 1;
      ++shift;
    }
    bits = sign | ((113u - static_cast<uint32_t>(shift)) << 23) | ((m & 0x3FFu) << 13);
  }
  return bf16_bits_to_float(bits);
}

// One block of 32 inputs as two int8 digits; see the file's head. Scalar: the reference every path must equal.
inline void quantize_block(const float* v, int8_t* c, int8_t* c2, float* scale, float* sum, int32_t* sum16) {
  float amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s[2] = {0, 0};
  for (int64_t i = 0; i < kBlock; ++i) {
    const float q = std::min(127.f, std::max(-127.f, std::nearbyint(v[i] * inv)));
    const float q2 = std::nearbyint((v[i] - q * d) * (256.f * inv));  // |remainder| <= d / 2: within +-128
    c[i] = static_cast<int8_t>(q);
    c2[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q2)));
    s[i / 16] += 256 * c[i] + c2[i];
  }
  *scale = d * (1.f / 256.f);
  *sum = static_cast<float>(s[0] + s[1]);
  sum16[0] = s[0];
  sum16[1] = s[1];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same block with AVX-512, 16 inputs a vector: the same IEEE operations in the same order (max is exact, no
// fused multiply-add, round to nearest even), so the same bits as quantize_block. Five times faster; it runs once
// per row and matmul, about a tenth of a batch-1 step in scalar code.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
inline void quantize_block16(const T* xb, int8_t* c, int8_t* c2, float* scale, float* sum, int32_t* sum16) {
  const __m512 v[2] = {load16(xb), load16(xb + 16)};
  // maxps / minps return their second operand when either is NaN: with the operands in this order they take NaN
  // and inf exactly as std::max / std::min do above (a NaN input is skipped by the max, clamped to -127 after)
  const __m512 zero = _mm512_setzero_ps();
  const float amax = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), zero), _mm512_max_ps(_mm512_abs_ps(v[1]), zero)));
  const float d = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 lim = _mm512_set1_ps(127.f), neg = _mm512_set1_ps(-127.f);
  auto clamp = [&](__m512 x) { return _mm512_min_ps(_mm512_max_ps(x, neg), lim); };
  int32_t s[2];
  for (int h = 0; h < 2; ++h) {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 q = clamp(_mm512_roundscale_ps(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)), kNearest));
    const __m512 rest = _mm512_sub_ps(v[h], _mm512_mul_ps(q, _mm512_set1_ps(d)));
    const __m512 q2 = clamp(_mm512_roundscale_ps(_mm512_mul_ps(rest, _mm512_set1_ps(256.f * inv)), kNearest));
    const __m512i qi = _mm512_cvtps_epi32(q), q2i = _mm512_cvtps_epi32(q2);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16 * h), _mm512_cvtepi32_epi8(qi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c2 + 16 * h), _mm512_cvtepi32_epi8(q2i));
    s[h] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(qi, 8), q2i));
  }
  *scale = d * (1.f / 256.f);
  *sum = static_cast<float>(s[0] + s[1]);
  sum16[0] = s[0];
  sum16[1] = s[1];
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t K, int8_t* codes, int8_t* low, float* scale, float* sum,
                   int32_t* sum16) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    float v[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* xb = x + r * K + b * kBlock;
        const int64_t at = r * K + b * kBlock, blk = r * blocks + b;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if constexpr (!std::is_same_v<T, double>) {
          quantize_block16(xb, codes + at, low + at, scale + blk, sum + blk, sum16 + 2 * blk);
          continue;
        }
#endif
        for (int64_t i = 0; i < kBlock; ++i) v[i] = static_cast<float>(xb[i]);
        quantize_block(v, codes + at, low + at, scale + blk, sum + blk, sum16 + 2 * blk);
      }
    }
  });
}

template <typename T>
inline void store_row(T* out, const float* v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(v[j]);  // round to nearest even, as Tensor.to does
}

template <int R>
using Rows = std::integral_constant<int, R>;
template <int T>
using Tiles = std::integral_constant<int, T>;

// y [M, N] in x's dtype = x [M, K] against packed weights, `tile_bytes` a tile of 16 columns.
// `tile(Rows<R>, Tiles<T>, a, m, w, out)` computes rows [m, m + R) against the T tiles that start at w (one after
// the other, `tile_bytes` apart) into out[r * 16 T + 16 t + column] (float); R is 4 or 1, T is `kTiles` (and 1
// for a last odd tile). Two tiles a pass let one broadcast of a row's activations feed two multiplies: a
// broadcast from memory issues once a cycle, and with one tile it was every other instruction of the loop.
template <int kTiles = 1, typename Tile>
at::Tensor quantized_gemm(const at::Tensor& x, const uint8_t* w, int64_t N, int64_t tile_bytes, Tile tile) {
  auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock;
  // one workspace: per-block scales and sums (float), half-block sums (int32), then both digits' int8 codes
  auto work = at::empty({M * (4 * blocks * 4 + 2 * K)}, x.options().dtype(at::kByte));
  float* scale = reinterpret_cast<float*>(work.data_ptr<uint8_t>());
  float* sum = scale + M * blocks;
  int32_t* sum16 = reinterpret_cast<int32_t*>(sum + M * blocks);
  int8_t* codes = reinterpret_cast<int8_t*>(sum16 + 2 * M * blocks);
  int8_t* low = codes + M * K;
  auto y = at::empty({M, N}, x.options());
  const int64_t tiles = N / kCols, groups = (tiles + kTiles - 1) / kTiles, row_blocks = (M + 63) / 64;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantized_gemm", [&] {
    quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), M, K, codes, low, scale, sum, sum16);
    const Quantized a{codes, low, scale, sum, sum16};
    scalar_t* yp = y.data_ptr<scalar_t>();
    // one work item: 64 rows against kTiles tiles, so a thread keeps those weights in L1 across the rows
    at::parallel_for(0, row_blocks * groups, 1, [&](int64_t begin, int64_t end) {
      float buf[64 * kCols * kTiles];
      for (int64_t item = begin; item < end; ++item) {
        const int64_t rb = item / groups, t = item % groups * kTiles, width = std::min<int64_t>(kTiles, tiles - t);
        const uint8_t* wt = w + t * tile_bytes;
        const int64_t first = rb * 64, stop = std::min(M, first + 64), ld = width * kCols;
        auto pass = [&](auto n) {  // buf holds rows [first, stop) of these tiles, ld floats each
          int64_t m = first;
          for (; m + kRows <= stop; m += kRows) tile(Rows<kRows>{}, n, a, m, wt, buf + (m - first) * ld);
          if (m + 2 <= stop) {  // a pair left (a sequence and its drafts): one pass over the tile, not two
            tile(Rows<2>{}, n, a, m, wt, buf + (m - first) * ld);
            m += 2;
          }
          for (; m < stop; ++m) tile(Rows<1>{}, n, a, m, wt, buf + (m - first) * ld);
        };
        if (width == kTiles) {
          pass(Tiles<kTiles>{});
        } else {
          pass(Tiles<1>{});
        }
        for (int64_t m = first; m < stop; ++m) store_row(yp + m * N + t * kCols, buf + (m - first) * ld, ld);
      }
    });
  });
  return y;
}

}  // namespace mlc
