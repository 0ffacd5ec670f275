// Fused elementwise steps of a decoder layer, each one pass over its rows instead of several eager ops. Each keeps
// the eager code's rounding: every intermediate the eager ops would store in the model's dtype is rounded to it here
// too, so with fp32 tables and inputs the results are the eager results, and rows never depend on each other.
//   rope_neox: half-split rotary over the query and key heads at the front of a fused QKV projection.
//   silu_mul: silu(gate) * up over a fused [gate | up] projection.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

template <typename T>
inline float rounded(float v) {  // what storing v as a T and reading it back gives
  return static_cast<float>(static_cast<T>(v));
}

// out[t, h, :] = x[t, h, :] * cos[t] + rotate_half(x[t, h, :]) * sin[t] for the first `heads` heads of each row
template <typename T>
void rope_rows(const T* x, int64_t row_stride, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
               int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / (heads * d)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * row_stride + h * d;
        T* o = out + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = rounded<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]));
          const float b = rounded<T>(-static_cast<float>(xr[i + half]) * static_cast<float>(s[i]));
          o[i] = static_cast<T>(a + b);
        }
        for (int64_t i = half; i < d; ++i) {
          const float a = rounded<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]));
          const float b = rounded<T>(static_cast<float>(xr[i - half]) * static_cast<float>(s[i]));
          o[i] = static_cast<T>(a + b);
        }
      }
    }
  });
}

at::Tensor rope_neox(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, width] with contiguous rows");
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= qkv.size(1), "heads x head_dim must fit in a row");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == qkv.size(0) && cos.size(1) == head_dim,
              "cos and sin must be [T, head_dim]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must have qkv's dtype");
  auto c = cos.contiguous(), s = sin.contiguous();
  const int64_t rows = qkv.size(0);
  auto out = at::empty({rows, heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_neox", [&] {
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), rows, heads, head_dim);
  });
  return out;
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlc_kernels, m) {
  m.def("rope_neox(Tensor qkv, Tensor cos, Tensor sin, int heads, int head_dim) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlc_kernels, CPU, m) {
  m.impl("rope_neox", &rope_neox);
  m.impl("silu_mul", &silu_mul);
}
