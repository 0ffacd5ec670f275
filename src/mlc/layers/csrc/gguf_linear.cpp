// The gguf kernel: y = x W^T with W in one of the GGUF block formats of gguf_blocks.h, read at the file's own bits
// (codes and scales as stored, repacked by gguf_pack into tiles of 16 output columns).
//
// The activations are the two int8 digits of quant_gemm.h (about 16 bits). For each step of 32 inputs and each
// column, the integer dot of the codes with both digits is exact (VNNI dpbusd, AVX2 maddubs, or plain C++: the same
// integers), and is folded in float in a fixed order:
//   zero-point formats   t = dot - zero * asum         acc = fma(t * S, d, acc)   (Q6_K: fma(t1, S1, t0 * S0))
//   scale-and-offset     acc = fma(fma(dot, S, O * asum), d, acc)
// where asum is the step's sum(256 a + a2), d its activation scale / 256, and S, O the file's sub-block scale and
// offset (fp16 d times a six-bit or int8 sub-block scale: exact in fp32). A row's result depends on that row alone.
#include "gguf_blocks.h"
#include "ops.h"
#include "quant_gemm.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace mlc;
using namespace mlc::gguf;

template <int KIND>
struct Spec {
  static constexpr Format f = kFormats[KIND];
  static constexpr bool sub16 = KIND == kQ6_K;
  static constexpr bool offset = f.zero < 0;
  static constexpr bool is_signed = f.zero == 128;  // Q8_0, IQ4: AVX2 multiplies them as signed bytes
};

// One step of one tile: its codes, its scale bytes, and its group's header.
struct StepAt {
  const uint8_t* codes;
  const uint8_t* meta;
  const uint8_t* header;
};

template <int KIND>
StepAt step_at(const uint8_t* tile, int64_t b) {
  constexpr Format f = kFormats[KIND];
  const uint8_t* group = tile + (b / f.steps) * group_bytes(f);
  const uint8_t* codes = group + f.header + (b % f.steps) * step_bytes(f);
  return {codes, codes + code_bytes(f), group};
}

inline float half_at(const uint8_t* p, int j) { return fp16_bits_to_float(half_bits(p + 2 * j)); }

#if defined(__AVX2__) && defined(__FMA__)
// every line of a step, kPrefetch ahead (the stream of a tile is contiguous: this covers the group headers too)
template <int KIND>
inline void prefetch_step(const StepAt& s) {
  for (int off = 0; off < step_bytes(kFormats[KIND]); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(s.codes) + off + kPrefetch, _MM_HINT_T1);
}
#endif

// The step's scales S0 (S1: Q6_K's second 16 inputs) and offsets O of column j, as the vector paths form them.
template <int KIND>
void scales_of(const StepAt& s, int j, float* s0, float* s1, float* o) {
  if constexpr (KIND == kQ5_1 || KIND == kQ4_1) {
    *s0 = half_at(s.meta, 2 * j);
    *o = half_at(s.meta, 2 * j + 1);
  } else if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    *s0 = half_at(s.header, 2 * j) * static_cast<float>(s.meta[j]);
    *o = -(half_at(s.header, 2 * j + 1) * static_cast<float>(s.meta[16 + j]));
  } else if constexpr (KIND == kQ6_K) {
    *s0 = half_at(s.header, j) * static_cast<float>(static_cast<int8_t>(s.meta[j]));
    *s1 = half_at(s.header, j) * static_cast<float>(static_cast<int8_t>(s.meta[16 + j]));
  } else if constexpr (KIND == kIQ4_XS) {
    *s0 = half_at(s.header, j) * static_cast<float>(static_cast<int8_t>(s.meta[j]));
  } else {
    *s0 = half_at(s.meta, j);
  }
}

// The stored code of column j, input k (0..31) of a step, as an unsigned byte (IQ4: its value + 128)
template <int KIND>
int32_t code_at(const uint8_t* codes, int j, int k) {
  constexpr Format f = kFormats[KIND];
  const int v = k / 4, i = k % 4;
  if constexpr (f.planes < 0) return codes[64 * v + 4 * j + i];
  const uint8_t byte = codes[64 * (v / 2) + 4 * j + i];
  int32_t c = v % 2 ? byte >> 4 : byte & 0x0F;
  for (int p = 0; p < f.planes; ++p) {
    uint64_t plane;
    std::memcpy(&plane, codes + 256 + 64 * p + 8 * v, 8);
    c |= static_cast<int32_t>((plane >> (4 * j + i)) & 1u) << (4 + p);
  }
  return f.table ? kIQ4Values[c] + 128 : c;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline __m512 half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int KIND>
void scales512(const StepAt& s, __m512* s0, __m512* s1, __m512* o) {
  if constexpr (KIND == kQ4_1 || KIND == kQ5_1 || KIND == kQ4_K || KIND == kQ5_K) {
    const __m512i pair = _mm512_loadu_si512(KIND <= kQ5_1 ? s.meta : s.header);
    const __m512 lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pair));
    const __m512 hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
    if constexpr (KIND <= kQ5_1) {
      *s0 = lo;
      *o = hi;
    } else {
      *s0 = _mm512_mul_ps(lo, u8x16(s.meta));
      *o = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(hi, u8x16(s.meta + 16)));
    }
  } else if constexpr (KIND == kQ6_K || KIND == kIQ4_XS) {
    const __m512 d = half16(s.header);
    *s0 = _mm512_mul_ps(d, i8x16(s.meta));
    if constexpr (KIND == kQ6_K) *s1 = _mm512_mul_ps(d, i8x16(s.meta + 16));
  } else {
    *s0 = half16(s.meta);
  }
}

// vector v (inputs 4v..4v+3 of the 16 columns) of a step's codes, unsigned (IQ4: value + 128)
template <int KIND>
__m512i codes512(const uint8_t* codes, int v) {
  constexpr Format f = kFormats[KIND];
  if constexpr (f.planes < 0) {
    return _mm512_loadu_si512(codes + 64 * v);
  } else {
    const __m512i packed = _mm512_loadu_si512(codes + 64 * (v / 2));
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512i c = v % 2 ? _mm512_and_si512(_mm512_srli_epi16(packed, 4), nib) : _mm512_and_si512(packed, nib);
    for (int p = 0; p < f.planes; ++p) {
      uint64_t bits;
      std::memcpy(&bits, codes + 256 + 64 * p + 8 * v, 8);
      c = _mm512_mask_add_epi8(c, _cvtu64_mask64(bits), c, _mm512_set1_epi8(static_cast<char>(16 << p)));
    }
    if constexpr (f.table) {
      const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129),
                                                                 static_cast<char>(141), static_cast<char>(153),
                                                                 static_cast<char>(166), static_cast<char>(181),
                                                                 static_cast<char>(197), static_cast<char>(217),
                                                                 static_cast<char>(241)));
      c = _mm512_shuffle_epi8(table, c);
    }
    return c;
  }
}

// One step of one row and tile into its accumulator: hi, lo are the two digits' dots (per Q6_K sub-block; else in
// [0]), in the fixed order every path folds in.
template <int KIND>
inline __m512 fold512(const __m512i* hi, const __m512i* lo, __m512 s0, __m512 s1, __m512 o, const int32_t* half,
                      float scale, __m512 acc) {
  using S = Spec<KIND>;
  __m512 u;
  if constexpr (S::sub16) {
    const __m512i t0 = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[0], 8), lo[0]),
                                        _mm512_set1_epi32(S::f.zero * half[0]));
    const __m512i t1 = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[1], 8), lo[1]),
                                        _mm512_set1_epi32(S::f.zero * half[1]));
    u = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t1), s1, _mm512_mul_ps(_mm512_cvtepi32_ps(t0), s0));
  } else {
    const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(hi[0], 8), lo[0]);
    if constexpr (S::offset) {
      const float asum = static_cast<float>(half[0] + half[1]);
      u = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s0, _mm512_mul_ps(o, _mm512_set1_ps(asum)));
    } else {
      const __m512i t = _mm512_sub_epi32(dot, _mm512_set1_epi32(S::f.zero * (half[0] + half[1])));
      u = _mm512_mul_ps(_mm512_cvtepi32_ps(t), s0);
    }
  }
  return _mm512_fmadd_ps(u, _mm512_set1_ps(scale), acc);
}

// Rows [m0, m0 + R) against T tiles (the next one tile_bytes after w), into y[r * 16 T + 16 t + column].
template <int KIND, int R, int T>
void tile_rows(const Quantized& a, int64_t m0, const uint8_t* w, int64_t tile_bytes, int64_t K, float* y) {
  using S = Spec<KIND>;
  const int64_t blocks = K / kBlock;
  auto act = [&](const int8_t* base, int r, int64_t k) {
    int32_t v;
    std::memcpy(&v, base + (m0 + r) * K + k, 4);
    return _mm512_set1_epi32(v);
  };
  // chains per row, tile and digit: integer sums are exact in any order, so they are split until 16 registers hold
  // them (a row alone overlaps its dpbusd latencies); Q6_K's 16-input sub-blocks take the first and second half
  constexpr int H = R * T <= 2 ? 4 : R * T == 4 ? 2 : 1;
  static_assert(!S::sub16 || H >= 2, "Q6_K keeps its two sub-blocks apart");
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    StepAt s[T];
    for (int t = 0; t < T; ++t) {
      s[t] = step_at<KIND>(w + t * tile_bytes, b);
      prefetch_step<KIND>(s[t]);
    }
    __m512i part[R][T][2][H];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        for (int d = 0; d < 2; ++d)
          for (int h = 0; h < H; ++h) part[r][t][d][h] = _mm512_setzero_si512();
#pragma GCC unroll 8  // whole: the accumulator indices become constants and stay in registers
    for (int v = 0; v < 8; ++v) {
      __m512i c[T];
      for (int t = 0; t < T; ++t) c[t] = codes512<KIND>(s[t].codes, v);
      const int h = S::sub16 ? (v / 4) * (H / 2) + v % (H / 2) : v % H;
      for (int r = 0; r < R; ++r) {  // each broadcast of a row's 4 activations feeds T multiplies
        const __m512i hi = act(a.codes, r, b * kBlock + 4 * v), lo = act(a.low, r, b * kBlock + 4 * v);
        for (int t = 0; t < T; ++t) {
          part[r][t][0][h] = _mm512_dpbusd_epi32(part[r][t][0][h], c[t], hi);
          part[r][t][1][h] = _mm512_dpbusd_epi32(part[r][t][1][h], c[t], lo);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      __m512 s0, s1, o;
      scales512<KIND>(s[t], &s0, &s1, &o);
      for (int r = 0; r < R; ++r) {
        __m512i sums[2][2];  // [digit][sub-block] (non-Q6_K: the whole step in [0])
        for (int d = 0; d < 2; ++d) {
          __m512i first = part[r][t][d][0], second = part[r][t][d][H / 2];
          for (int h = 1; h < H / 2; ++h) {
            first = _mm512_add_epi32(first, part[r][t][d][h]);
            second = _mm512_add_epi32(second, part[r][t][d][H / 2 + h]);
          }
          if constexpr (H == 1) {
            sums[d][0] = first;
          } else {
            sums[d][0] = S::sub16 ? first : _mm512_add_epi32(first, second);
            sums[d][1] = second;
          }
        }
        const int64_t at = (m0 + r) * blocks + b;
        acc[r][t] = fold512<KIND>(sums[0], sums[1], s0, s1, o, a.sum16 + 2 * at, a.scale[at], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + r * kCols * T + t * kCols, acc[r][t]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 uint32 lanes holding a value below 2^16 each -> those 8 values as uint16, in order (for F16C's cvtph)
inline __m128i halves(__m256i v) {
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

// scales of columns 8 col .. 8 col + 7
template <int KIND>
void scales256(const StepAt& s, int col, __m256* s0, __m256* s1, __m256* o) {
  if constexpr (KIND == kQ4_1 || KIND == kQ5_1 || KIND == kQ4_K || KIND == kQ5_K) {
    const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>((KIND <= kQ5_1 ? s.meta : s.header) +
                                                                              32 * col));
    const __m256 lo = _mm256_cvtph_ps(halves(_mm256_and_si256(pair, _mm256_set1_epi32(0xFFFF))));
    const __m256 hi = _mm256_cvtph_ps(halves(_mm256_srli_epi32(pair, 16)));
    if constexpr (KIND <= kQ5_1) {
      *s0 = lo;
      *o = hi;
    } else {
      *s0 = _mm256_mul_ps(lo, u8x8(s.meta + 8 * col));
      *o = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(hi, u8x8(s.meta + 16 + 8 * col)));
    }
  } else if constexpr (KIND == kQ6_K || KIND == kIQ4_XS) {
    const __m256 d = half8(s.header + 16 * col);
    *s0 = _mm256_mul_ps(d, i8x8(s.meta + 8 * col));
    if constexpr (KIND == kQ6_K) *s1 = _mm256_mul_ps(d, i8x8(s.meta + 16 + 8 * col));
  } else {
    *s0 = half8(s.meta + 16 * col);
  }
}

// columns 8 col .. 8 col + 7 of vector v; unsigned, or for Q8_0 and IQ4 the signed value
template <int KIND>
__m256i codes256(const uint8_t* codes, int v, int col) {
  constexpr Format f = kFormats[KIND];
  if constexpr (f.planes < 0) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * v + 32 * col));
    return _mm256_xor_si256(c, _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * (v / 2) + 32 * col));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    __m256i c = v % 2 ? _mm256_and_si256(_mm256_srli_epi16(packed, 4), nib) : _mm256_and_si256(packed, nib);
    const __m256i select = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    for (int p = 0; p < f.planes; ++p) {
      int32_t bits;
      std::memcpy(&bits, codes + 256 + 64 * p + 8 * v + 4 * col, 4);
      const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), select);
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      c = _mm256_add_epi8(c, _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(16 << p))));
    }
    if constexpr (f.table) {
      const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
      c = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(values), c);
    }
    return c;
  }
}

template <int KIND, int R>
void tile_rows_one(const Quantized& a, int64_t m0, const uint8_t* w, int64_t K, float* y) {
  using S = Spec<KIND>;
  const int64_t blocks = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  // u8 x s8 pairs to int16 (unsigned codes up to 63, or |q| up to 128 against |a| <= 127: no saturation)
  auto dot4 = [&](__m256i c, const int8_t* base, int r, int64_t k) {
    int32_t v;
    std::memcpy(&v, base + (m0 + r) * K + k, 4);
    const __m256i av = _mm256_set1_epi32(v);
    if constexpr (S::is_signed) return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c),
                                                                               _mm256_sign_epi8(av, c)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(c, av), ones);
  };
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const StepAt s = step_at<KIND>(w, b);
    prefetch_step<KIND>(s);
    for (int col = 0; col < 2; ++col) {
      __m256i part[R][2][2];  // [row][digit][Q6_K's 16-input sub-block]
      for (int r = 0; r < R; ++r)
        for (int d = 0; d < 2; ++d) part[r][d][0] = part[r][d][1] = _mm256_setzero_si256();
#pragma GCC unroll 8  // whole: the accumulator indices become constants and stay in registers
      for (int v = 0; v < 8; ++v) {
        const __m256i c = codes256<KIND>(s.codes, v, col);
        const int h = S::sub16 ? v / 4 : 0;
        for (int r = 0; r < R; ++r) {
          part[r][0][h] = _mm256_add_epi32(part[r][0][h], dot4(c, a.codes, r, b * kBlock + 4 * v));
          part[r][1][h] = _mm256_add_epi32(part[r][1][h], dot4(c, a.low, r, b * kBlock + 4 * v));
        }
      }
      __m256 s0, s1, o;
      scales256<KIND>(s, col, &s0, &s1, &o);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * blocks + b;
        const int32_t* half = a.sum16 + 2 * at;
        // signed formats already hold the zero-point-free dot (q - 128 multiplied directly)
        const int32_t zero = S::is_signed ? 0 : S::f.zero;
        __m256 u;
        if constexpr (S::sub16) {
          const __m256i t0 = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(part[r][0][0], 8), part[r][1][0]),
                                              _mm256_set1_epi32(zero * half[0]));
          const __m256i t1 = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(part[r][0][1], 8), part[r][1][1]),
                                              _mm256_set1_epi32(zero * half[1]));
          u = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t1), s1, _mm256_mul_ps(_mm256_cvtepi32_ps(t0), s0));
        } else {
          const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(part[r][0][0], 8), part[r][1][0]);
          if constexpr (S::offset) {
            const float asum = static_cast<float>(half[0] + half[1]);
            u = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s0, _mm256_mul_ps(o, _mm256_set1_ps(asum)));
          } else {
            const __m256i t = _mm256_sub_epi32(dot, _mm256_set1_epi32(zero * (half[0] + half[1])));
            u = _mm256_mul_ps(_mm256_cvtepi32_ps(t), s0);
          }
        }
        acc[r][col] = _mm256_fmadd_ps(u, _mm256_set1_ps(a.scale[at]), acc[r][col]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * kCols, acc[r][0]);
    _mm256_storeu_ps(y + r * kCols + 8, acc[r][1]);
  }
}

#else
template <int KIND, int R>
void tile_rows_one(const Quantized& a, int64_t m0, const uint8_t* w, int64_t K, float* y) {
  using S = Spec<KIND>;
  const int64_t blocks = K / kBlock;
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kCols; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const StepAt s = step_at<KIND>(w, b);
        int32_t dot[2] = {0, 0};  // per 16 inputs: sum (code - zero) (256 a + a2), or sum code (256 a + a2)
        for (int k = 0; k < kBlock; ++k) {
          const int64_t at = (m0 + r) * K + b * kBlock + k;
          const int32_t q = code_at<KIND>(s.codes, j, k) - (S::offset ? 0 : S::f.zero);
          dot[k / 16] += q * (256 * a.codes[at] + a.low[at]);
        }
        float s0 = 0.f, s1 = 0.f, o = 0.f;
        scales_of<KIND>(s, j, &s0, &s1, &o);
        const int64_t at = (m0 + r) * blocks + b;
        const int32_t* half = a.sum16 + 2 * at;
        float u;
        if constexpr (S::sub16) {
          u = std::fma(static_cast<float>(dot[1]), s1, static_cast<float>(dot[0]) * s0);
        } else if constexpr (S::offset) {
          u = std::fma(static_cast<float>(dot[0] + dot[1]), s0, o * static_cast<float>(half[0] + half[1]));
        } else {
          u = static_cast<float>(dot[0] + dot[1]) * s0;
        }
        acc = std::fma(u, a.scale[at], acc);
      }
      y[r * kCols + j] = acc;
    }
  }
}
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// AVX2 and plain C++: one tile at a time (each column's result is computed alone either way)
template <int KIND, int R, int T>
void tile_rows(const Quantized& a, int64_t m0, const uint8_t* w, int64_t tile_bytes, int64_t K, float* y) {
  float one[R * kCols];
  for (int t = 0; t < T; ++t) {
    tile_rows_one<KIND, R>(a, m0, w + t * tile_bytes, K, one);
    for (int r = 0; r < R; ++r) std::memcpy(y + r * kCols * T + t * kCols, one + r * kCols, sizeof(float) * kCols);
  }
}
#endif

template <int KIND, int kTiles>
at::Tensor run_tiles(const at::Tensor& x, const at::Tensor& packed) {
  const int64_t K = x.size(1), tile_bytes = packed.size(1) * packed.size(2);
  return quantized_gemm<kTiles>(x, packed.data_ptr<uint8_t>(), packed.size(0) * kCols, tile_bytes,
                                [&](auto rows, auto tiles, const Quantized& a, int64_t m, const uint8_t* w,
                                    float* out) {
                                  tile_rows<KIND, decltype(rows)::value, decltype(tiles)::value>(a, m, w, tile_bytes,
                                                                                                 K, out);
                                });
}

// Batches of rows take two tiles a pass (half the activation broadcasts); a lone row (decode) reads one stream a
// thread, which memory serves faster than two (24 against 21 GB/s on a 1B layer stack). Q6_K keeps two chains a
// digit for its sub-blocks: with two tiles its accumulators would not fit the registers. The bits are the same
// either way: each column is computed alone.
template <int KIND>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed) {
  if constexpr (KIND == gguf::kQ6_K) {
    return run_tiles<KIND, 1>(x, packed);
  } else {
    return x.size(0) < kRows ? run_tiles<KIND, 1>(x, packed) : run_tiles<KIND, 2>(x, packed);
  }
}

}  // namespace

namespace mlc {

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(kind >= 0 && kind < gguf::kKinds, "unknown gguf kernel format ", kind);
  const gguf::Format& f = gguf::kFormats[kind];
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == gguf::group_bytes(f),
              "packed weights must be uint8 [N/16, groups, ", gguf::group_bytes(f), "] (gguf_pack's layout)");
  TORCH_CHECK(packed.size(1) * 32 * f.steps == x.size(1), "packed weights cover ", packed.size(1) * 32 * f.steps,
              " inputs, x has ", x.size(1));
  TORCH_CHECK(packed.is_contiguous(), "packed weights must be contiguous");
  switch (kind) {
    case gguf::kQ4_0: return run<gguf::kQ4_0>(x, packed);
    case gguf::kQ4_1: return run<gguf::kQ4_1>(x, packed);
    case gguf::kQ5_0: return run<gguf::kQ5_0>(x, packed);
    case gguf::kQ5_1: return run<gguf::kQ5_1>(x, packed);
    case gguf::kQ8_0: return run<gguf::kQ8_0>(x, packed);
    case gguf::kIQ4_NL: return run<gguf::kIQ4_NL>(x, packed);
    case gguf::kQ4_K: return run<gguf::kQ4_K>(x, packed);
    case gguf::kQ5_K: return run<gguf::kQ5_K>(x, packed);
    case gguf::kQ6_K: return run<gguf::kQ6_K>(x, packed);
    default: return run<gguf::kIQ4_XS>(x, packed);
  }
}

}  // namespace mlc
