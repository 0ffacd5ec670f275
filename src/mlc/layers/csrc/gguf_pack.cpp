// A GGUF matrix's blocks, as mapped from the file, into the gguf kernel's tiles (`gguf_pack`), and rows of it back to
// floats (`gguf_rows`, the embedding lookup of a model served from its GGUF). Both keep the file's codes and scale
// bytes; gguf_rows computes each value as llama.cpp's dequantization does (the same fp32 operations, in its order).
#include <ATen/Parallel.h>

#include <atomic>

#include "gguf_blocks.h"
#include "huge_pages.h"
#include "ops.h"
#include "quant_gemm.h"

namespace {

using namespace mlc;
using namespace mlc::gguf;

// an fp16 scale that is inf or nan: a damaged block (every value of it would be nan)
inline bool bad_half(const uint8_t* p) { return (half_bits(p) & 0x7C00u) == 0x7C00u; }

// where a block keeps its fp16 scales (d; and m or dmin)
template <int KIND>
bool bad_scales(const uint8_t* b) {
  if constexpr (KIND == kQ6_K) return bad_half(b + 208);
  if constexpr (KIND == kQ4_1 || KIND == kQ5_1 || KIND == kQ4_K || KIND == kQ5_K) return bad_half(b) || bad_half(b + 2);
  return bad_half(b);
}

// column j's codes, scales and (super-block) header of one group of one tile; false for a damaged block
template <int KIND>
bool pack_column(const uint8_t* row, int64_t g, int j, uint8_t* out) {
  constexpr Format f = kFormats[KIND];
  constexpr int planes = f.planes;
  const uint8_t* super = row + g * f.block_bytes;  // the group's block (K formats: its one super-block)
  if (bad_scales<KIND>(super)) return false;
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) std::memcpy(out + 4 * j, super, 4);  // d, dmin
  if constexpr (KIND == kQ6_K) std::memcpy(out + 2 * j, super + 208, 2);
  if constexpr (KIND == kIQ4_XS) std::memcpy(out + 2 * j, super, 2);
  for (int s = 0; s < f.steps; ++s) {
    uint8_t* step = out + f.header + s * step_bytes(f);
    for (int k = 0; k < 32; ++k) {
      const uint8_t c = code(static_cast<Kind>(KIND), super, 32 * s + k);
      const int v = k / 4, at = 4 * j + k % 4;
      if constexpr (planes < 0) {
        step[64 * v + at] = c;
      } else {
        step[64 * (v / 2) + at] |= static_cast<uint8_t>((c & 0x0F) << (4 * (v % 2)));
        for (int p = 0; p < planes; ++p)
          step[256 + 64 * p + 8 * v + at / 8] |= static_cast<uint8_t>(((c >> (4 + p)) & 1u) << (at % 8));
      }
    }
    uint8_t* meta = step + code_bytes(f);
    if constexpr (KIND == kQ5_1 || KIND == kQ4_1) {
      std::memcpy(meta + 4 * j, super, 4);  // d, m
    } else if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
      k_scale_min(super + 4, s, meta + j, meta + 16 + j);
    } else if constexpr (KIND == kQ6_K) {
      meta[j] = super[192 + 2 * s];
      meta[16 + j] = super[192 + 2 * s + 1];
    } else if constexpr (KIND == kIQ4_XS) {
      meta[j] = static_cast<uint8_t>(iq4xs_scale(super, s));
    } else {
      std::memcpy(meta + 2 * j, super, 2);  // d
    }
  }
  return true;
}

// -1, or the first row holding a damaged block
template <int KIND>
int64_t pack(const uint8_t* raw, int64_t N, int64_t row_bytes, int64_t groups, uint8_t* packed) {
  constexpr int64_t gb = group_bytes(kFormats[KIND]);
  std::atomic<int64_t> bad{N};
  at::parallel_for(0, N / kCols * groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / groups, g = item % groups;
      uint8_t* out = packed + item * gb;
      std::memset(out, 0, gb);
      for (int j = 0; j < kCols; ++j) {
        const int64_t n = t * kCols + j;
        if (!pack_column<KIND>(raw + n * row_bytes, g, j, out)) {
          int64_t seen = bad.load();
          while (n < seen && !bad.compare_exchange_weak(seen, n)) {
          }
        }
      }
    }
  });
  return bad.load() < N ? bad.load() : -1;
}

// value e of one block as llama.cpp's dequantize_row_* computes it
float value(Kind kind, const uint8_t* b, int e) {
  const int32_t c = code(kind, b, e);
  auto d_at = [&](int at) { return fp16_bits_to_float(half_bits(b + at)); };
  switch (kind) {
    case kQ4_0: return d_at(0) * static_cast<float>(c - 8);
    case kQ5_0: return d_at(0) * static_cast<float>(c - 16);
    case kQ8_0: return d_at(0) * static_cast<float>(c - 128);
    case kIQ4_NL: return d_at(0) * static_cast<float>(kIQ4Values[c]);
    case kQ4_1:
    case kQ5_1: return d_at(0) * static_cast<float>(c) + d_at(2);
    case kQ4_K:
    case kQ5_K: {
      uint8_t sc, m;
      k_scale_min(b + 4, e / 32, &sc, &m);
      return d_at(0) * static_cast<float>(sc) * static_cast<float>(c) - d_at(2) * static_cast<float>(m);
    }
    case kQ6_K:
      return d_at(208) * static_cast<float>(static_cast<int8_t>(b[192 + e / 16])) * static_cast<float>(c - 32);
    case kIQ4_XS:
      return d_at(0) * static_cast<float>(iq4xs_scale(b, e / 32)) * static_cast<float>(kIQ4Values[c]);
    default:
      return 0.f;
  }
}

int64_t row_bytes_of(const Format& f, int64_t K) { return K / f.block_values * f.block_bytes; }

void check_raw(const at::Tensor& raw, const Format& f, int64_t K) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "raw GGUF blocks must be a contiguous uint8 [rows, bytes per row]");
  TORCH_CHECK(K % (32 * f.steps) == 0 && K % f.block_values == 0, "rows of ", K, " values are not whole blocks");
  TORCH_CHECK(raw.size(1) == row_bytes_of(f, K), "a row of ", K, " values takes ", row_bytes_of(f, K),
              " bytes in this format, the raw rows hold ", raw.size(1));
}

}  // namespace

namespace mlc {

at::Tensor gguf_pack(const at::Tensor& raw, int64_t kind, int64_t K) {
  TORCH_CHECK(kind >= 0 && kind < gguf::kKinds, "unknown gguf kernel format ", kind);
  const gguf::Format& f = gguf::kFormats[kind];
  check_raw(raw, f, K);
  const int64_t N = raw.size(0), groups = K / (32 * f.steps);
  TORCH_CHECK(N % kCols == 0, "the gguf kernel takes output rows in tiles of 16; this matrix has ", N);
  auto packed = huge_page_bytes(N / kCols * groups * gguf::group_bytes(f), raw.options())  // see huge_pages.h
                    .view({N / kCols, groups, gguf::group_bytes(f)});
  const uint8_t* r = raw.data_ptr<uint8_t>();
  uint8_t* p = packed.data_ptr<uint8_t>();
  const int64_t rb = raw.size(1);
  int64_t bad = -1;
  switch (kind) {
    case gguf::kQ4_0: bad = pack<gguf::kQ4_0>(r, N, rb, groups, p); break;
    case gguf::kQ4_1: bad = pack<gguf::kQ4_1>(r, N, rb, groups, p); break;
    case gguf::kQ5_0: bad = pack<gguf::kQ5_0>(r, N, rb, groups, p); break;
    case gguf::kQ5_1: bad = pack<gguf::kQ5_1>(r, N, rb, groups, p); break;
    case gguf::kQ8_0: bad = pack<gguf::kQ8_0>(r, N, rb, groups, p); break;
    case gguf::kQ4_K: bad = pack<gguf::kQ4_K>(r, N, rb, groups, p); break;
    case gguf::kQ5_K: bad = pack<gguf::kQ5_K>(r, N, rb, groups, p); break;
    case gguf::kQ6_K: bad = pack<gguf::kQ6_K>(r, N, rb, groups, p); break;
    case gguf::kIQ4_NL: bad = pack<gguf::kIQ4_NL>(r, N, rb, groups, p); break;
    default: bad = pack<gguf::kIQ4_XS>(r, N, rb, groups, p); break;
  }
  TORCH_CHECK(bad < 0, "damaged block: row ", bad, " holds a block whose fp16 scale is inf or nan");
  return packed;
}

at::Tensor gguf_rows(const at::Tensor& raw, const at::Tensor& ids, int64_t kind, int64_t K) {
  TORCH_CHECK(kind >= 0 && kind < gguf::kKinds, "unknown gguf kernel format ", kind);
  const gguf::Format& f = gguf::kFormats[kind];
  check_raw(raw, f, K);
  auto idx = ids.to(at::kLong).contiguous().view({-1});
  const int64_t n = idx.size(0), V = raw.size(0), blocks = K / f.block_values;
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < V, "token id ", ip[i], " is out of range");
  auto out = at::empty({n, K}, raw.options().dtype(at::kFloat));
  const uint8_t* r = raw.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = r + ip[i] * raw.size(1) + b * f.block_bytes;
        for (int e = 0; e < f.block_values; ++e)
          o[i * K + b * f.block_values + e] = value(static_cast<gguf::Kind>(kind), blk, e);
      }
  });
  return out;
}

}  // namespace mlc
