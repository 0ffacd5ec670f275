// Fused elementwise steps of a decoder layer, each one pass over its rows instead of several eager ops. Each keeps
// the eager code's rounding: every intermediate the eager ops would store in the model's dtype is rounded to it here
// too, so with fp32 tables and inputs the results are the eager results, and rows never depend on each other.
//   rms_norm: RMSNorm in transformers' order for a 16-bit model.
//   rope_neox: half-split rotary over the query and key heads at the front of a fused QKV projection (over the
//     first cos-width dims of each head, the rest copied: GLM-4.5's partial rotary).
//   rope_interleaved: GLM's interleaved (pairwise) partial rotary over the same heads.
//   silu_mul: silu(gate) * up over a fused [gate | up] projection.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

template <typename T>
inline float rounded(float v) {  // what storing v as a T and reading it back gives
  return static_cast<float>(static_cast<T>(v));
}

// RMSNorm of each row in transformers' order for a 16-bit model: normalize in float, round to the model's dtype,
// then multiply by the weight (rounded again). One pass per row instead of seven eager ops; each row alone.
template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sq(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float v = static_cast<float>(xr[i]);
        sq[i] = v * v;
      }
      const float inv = 1.f / std::sqrt(mlc::lane_sum(sq.data(), n) / static_cast<float>(n) + eps);
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const T h = static_cast<T>(static_cast<float>(xr[i]) * inv);
        o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(h));
      }
    }
  });
}

// out[t, h, :] = x[t, h, :] * cos[t] + rotate_half(x[t, h, :]) * sin[t] for the first `heads` heads of each row
template <typename T>
void rope_rows(const T* x, int64_t row_stride, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
               int64_t d, int64_t rot) {
  const int64_t half = rot / 2;
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / (heads * d)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * rot;
      const T* s = sin + t * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * row_stride + h * d;
        T* o = out + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = rounded<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]));
          const float b = rounded<T>(-static_cast<float>(xr[i + half]) * static_cast<float>(s[i]));
          o[i] = static_cast<T>(a + b);
        }
        for (int64_t i = half; i < rot; ++i) {
          const float a = rounded<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]));
          const float b = rounded<T>(static_cast<float>(xr[i - half]) * static_cast<float>(s[i]));
          o[i] = static_cast<T>(a + b);
        }
        for (int64_t i = rot; i < d; ++i) o[i] = xr[i];
      }
    }
  });
}

// GLM's interleaved rotary over the first `rot` dims of the first `heads` heads of each row (pairs 2j, 2j+1 turned by
// cos[t, j], sin[t, j]; the rest of each head copied): rotary.apply_rope_interleaved's roundings, op by op
template <typename T>
void rope_pairs_rows(const T* x, int64_t row_stride, const T* cos, const T* sin, int64_t table_stride, T* out,
                     int64_t rows, int64_t heads, int64_t d, int64_t rot) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / (heads * d)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * table_stride;
      const T* s = sin + t * table_stride;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * row_stride + h * d;
        T* o = out + (t * heads + h) * d;
        for (int64_t j = 0; j < rot / 2; ++j) {
          const float e = static_cast<float>(xr[2 * j]), od = static_cast<float>(xr[2 * j + 1]);
          const float cj = static_cast<float>(c[j]), sj = static_cast<float>(s[j]);
          o[2 * j] = static_cast<T>(rounded<T>(e * cj) - rounded<T>(od * sj));
          o[2 * j + 1] = static_cast<T>(rounded<T>(od * cj) + rounded<T>(e * sj));
        }
        for (int64_t i = rot; i < d; ++i) o[i] = xr[i];
      }
    }
  });
}

// silu(g) = g / (1 + exp(-g)), from exp of a non-positive argument only (no overflow)
inline float silu(float g) {
  const float e = mlc::exp_nonpositive(-std::fabs(g));
  return g >= 0.f ? g / (1.f + e) : g * e / (1.f + e);
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        o[i] = static_cast<T>(rounded<T>(silu(static_cast<float>(gate[i]))) * static_cast<float>(up[i]));
      }
    }
  });
}

// The rotary ops' shared checks and dispatch: the first `heads` heads of each row of a fused [T, width] projection,
// rotated over cos's width (half-split, or GLM's pairs), into [T, heads, head_dim]
at::Tensor rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                  int64_t head_dim, bool pairs) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, width] with contiguous rows");
  TORCH_CHECK(heads * head_dim <= qkv.size(1), "heads x head_dim must fit in a row");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == qkv.size(0) && cos.size(1) % 2 == 0 &&
                  cos.size(1) <= head_dim,
              "cos and sin must be [T, rotary dims], the rotary dims even and at most head_dim");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must have qkv's dtype");
  auto c = cos.contiguous(), s = sin.contiguous();
  const int64_t rows = qkv.size(0), rot = c.size(1);
  auto out = at::empty({rows, heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary", [&] {
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    if (pairs) {
      rope_pairs_rows<scalar_t>(x, qkv.stride(0), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(), rot,
                                out.data_ptr<scalar_t>(), rows, heads, head_dim, rot);
    } else {
      rope_rows<scalar_t>(x, qkv.stride(0), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                          rows, heads, head_dim, rot);
    }
  });
  return out;
}

}  // namespace

namespace mlc {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight share one dtype");
  TORCH_CHECK(x.size(-1) == weight.numel(), "the weight covers the last dimension");
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n,
                       static_cast<float>(eps));
  });
  return out;
}

at::Tensor rope_neox(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t head_dim) {
  return rotary(qkv, cos, sin, heads, head_dim, false);
}

at::Tensor rope_interleaved(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                            int64_t head_dim) {
  return rotary(qkv, cos, sin, heads, head_dim, true);
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 * width] (gate then up)");
  auto xc = x.contiguous();
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  auto out = at::empty({rows, width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width);
  });
  return out;
}

}  // namespace mlc
