// The GGUF block formats the gguf kernel serves at their own bits, and the layout it reads them in.
//
// Each format's values are `w = S * (code - zero)` (zero-point formats) or `w = S * code + O` (scale-and-offset
// formats), with S and O per sub-block of 32 inputs (16 for Q6_K). A file's block is decoded here into the codes
// and the scale bytes exactly as stored (fp16 bits, six-bit or int8 sub-block scales), never into floats: the
// kernel forms S and O from them (exact in fp32) and so computes with the file's values.
//
// Packed layout (`gguf_pack`): uint8 [N/16, K/(32 * steps), group_bytes], one stream per tile of 16 output columns.
// A group is `header` bytes (a super-block's fp16 scales of its 16 columns) and then `steps` steps of 32 inputs,
// each its codes and `meta` bytes of sub-block scales. The codes of a step are 8 vectors of 64 bytes, vector v
// holding inputs 4v..4v+3 of the 16 columns, byte 4j+i column j's input 4v+i:
//   4-bit codes: 4 chunks of 64 bytes, chunk c's byte 4j+i holding vector 2c's code in its low nibble and vector
//     2c+1's in its high nibble (the int4 kernel's chunks); then, for 5- and 6-bit codes, one or two planes of the
//     codes' bits 4 and 5: 8 bytes a vector, bit 4j+i of the little-endian uint64;
//   8-bit codes (Q8_0): the 8 vectors' bytes, code = q + 128.
#pragma once

#include <cstdint>
#include <cstring>

namespace mlc::gguf {

// the order of GGUF_KINDS in mlc/layers/gguf_linear.py
enum Kind : int64_t { kQ4_0 = 0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kIQ4_NL, kIQ4_XS, kKinds };

struct Format {
  int planes;        // bit planes above the nibbles: 0, 1 (5-bit), 2 (6-bit); -1: a byte per code (Q8_0)
  bool table;        // the codes index kIQ4Values
  int zero;          // the code of 0 (zero-point formats); -1: scale and offset (Q5_1, Q4_K, Q5_K)
  int steps;         // steps (32 inputs) per group: 1, or 8 for the 256-value super-blocks
  int header;        // bytes at the start of a group: fp16 d (and dmin) of its 16 columns
  int meta;          // bytes after a step's codes: its sub-block scales of the 16 columns
  int block_values;  // in the GGUF file
  int block_bytes;
};

constexpr Format kFormats[kKinds] = {
    /* Q4_0   */ {0, false, 8, 1, 0, 32, 32, 18},     // meta: fp16 d
    /* Q4_1   */ {0, false, -1, 1, 0, 64, 32, 20},    // meta: (fp16 d, fp16 m) pairs
    /* Q5_0   */ {1, false, 16, 1, 0, 32, 32, 22},    // meta: fp16 d
    /* Q5_1   */ {1, false, -1, 1, 0, 64, 32, 24},    // meta: (fp16 d, fp16 m) pairs
    /* Q8_0   */ {-1, false, 128, 1, 0, 32, 32, 34},  // meta: fp16 d
    /* Q4_K   */ {0, false, -1, 8, 64, 32, 256, 144}, // header: (d, dmin) pairs; meta: u8 sc x 16, u8 m x 16
    /* Q5_K   */ {1, false, -1, 8, 64, 32, 256, 176}, // as Q4_K
    /* Q6_K   */ {2, false, 32, 8, 32, 32, 256, 210}, // header: d; meta: int8 sc of inputs 0-15 x 16, 16-31 x 16
    /* IQ4_NL */ {0, true, 128, 1, 0, 32, 32, 18},    // meta: fp16 d
    /* IQ4_XS */ {0, true, 128, 8, 32, 16, 256, 136}, // header: d; meta: int8 (ls - 32) x 16
};

constexpr int code_bytes(const Format& f) { return f.planes < 0 ? 512 : 256 + 64 * f.planes; }
constexpr int step_bytes(const Format& f) { return code_bytes(f) + f.meta; }
constexpr int group_bytes(const Format& f) { return f.header + f.steps * step_bytes(f); }

// IQ4_NL / IQ4_XS values (llama.cpp's kvalues_iq4nl); the kernel stores index i and reads kIQ4Values[i] + 128
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// Q4_K / Q5_K: sub-block j's six-bit scale and minimum from the 12 packed bytes (llama.cpp's get_scale_min_k4)
inline void k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The stored code of value e (0 .. block_values - 1) of one block: unsigned, as the packed layout keeps it
inline uint8_t code(Kind kind, const uint8_t* b, int e) {
  switch (kind) {
    case kQ4_0:
    case kQ4_1:
    case kIQ4_NL: {
      const uint8_t q = b[(kind == kQ4_1 ? 4 : 2) + e % 16];
      return e < 16 ? q & 0x0F : q >> 4;
    }
    case kQ5_0:
    case kQ5_1: {
      const int at = kind == kQ5_0 ? 2 : 4;  // after d (and m)
      uint32_t qh;
      std::memcpy(&qh, b + at, 4);
      const uint8_t q = b[at + 4 + e % 16];
      return static_cast<uint8_t>((e < 16 ? q & 0x0F : q >> 4) | (((qh >> e) & 1u) << 4));
    }
    case kQ8_0:
      return static_cast<uint8_t>(static_cast<int8_t>(b[2 + e]) + 128);
    case kQ4_K:
    case kQ5_K: {
      const int pair = e / 64, high = (e / 32) % 2, l = e % 32;
      const uint8_t* qs = b + (kind == kQ4_K ? 16 : 48);
      const uint8_t lo = high ? qs[32 * pair + l] >> 4 : qs[32 * pair + l] & 0x0F;
      if (kind == kQ4_K) return lo;
      return static_cast<uint8_t>(lo | (((b[16 + l] >> (e / 32)) & 1u) << 4));  // qh[l] bit (sub-block index)
    }
    case kQ6_K: {
      const int half = e / 128, quarter = (e % 128) / 32, l = e % 32;
      const uint8_t q = b[64 * half + l + 32 * (quarter & 1)];
      const uint8_t lo = quarter < 2 ? q & 0x0F : q >> 4;
      return static_cast<uint8_t>(lo | (((b[128 + 32 * half + l] >> (2 * quarter)) & 3u) << 4));
    }
    case kIQ4_XS: {
      const uint8_t q = b[8 + 16 * (e / 32) + e % 16];
      return (e % 32) < 16 ? q & 0x0F : q >> 4;
    }
    default:
      return 0;
  }
}

// IQ4_XS: sub-block j's scale, ls - 32 (six bits in scales_h / scales_l)
inline int8_t iq4xs_scale(const uint8_t* b, int j) {
  const uint16_t h = half_bits(b + 2);
  const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((h >> (2 * j)) & 3) << 4);
  return static_cast<int8_t>(ls - 32);
}

}  // namespace mlc::gguf
