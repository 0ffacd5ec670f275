// One Llama, GLM or GLM-4-0414 decoder layer for a step of decode tokens, as one op: the eager layer's own kernels
// (rms_norm, the gguf kernel, rope_neox or rope_interleaved, decode_attention, silu_mul) called in the eager order
// on the same tensors, so the result is bit for bit the eager layer's. What it saves is the forty-odd Python calls
// and op dispatches between them, a quarter of a decode step on the default model (ARCHITECTURE.md, "Defaults and
// speed"; models/fused_decode.py decides when a layer qualifies).
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "ops.h"

namespace {

// A projection of one or more runs of equal format (GGUFLinear.matmul: one kernel call a run, joined by columns)
at::Tensor project(const at::Tensor& x, at::TensorList runs, at::IntArrayRef kinds) {
  if (runs.size() == 1) return mlc::gguf_linear(x, runs[0], kinds[0]);
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < runs.size(); ++i) ys.push_back(mlc::gguf_linear(x, runs[i], kinds[i]));
  return at::cat(ys, -1);
}

}  // namespace

namespace mlc {

// dims: heads, kv heads, head_dim, rope (0: half-split over all of head_dim, 1: GLM's interleaved pairs over cos's
// width), sandwich norms (GLM-4-0414: a norm on the attention and the MLP outputs before each residual add), a
// qkv bias, then the runs of qkv, o, gate|up and down. weights: the input and post-attention norms, the two
// sandwich norms where there are, the qkv bias where there is, then every run's packed tiles.
at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                        at::IntArrayRef kinds, at::IntArrayRef dims, double eps, double scale,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                        const at::Tensor& pages, const at::Tensor& ctx, int64_t page_size) {
  TORCH_CHECK(dims.size() == 10, "dims: heads, kv heads, head_dim, rope, sandwich, bias, then the runs of qkv, o, "
              "gate|up and down");
  TORCH_CHECK(h.dim() == 2, "h must be [T, hidden]");
  const int64_t t = h.size(0), heads = dims[0], kv_heads = dims[1], d = dims[2];
  const bool interleaved = dims[3] == 1, sandwich = dims[4] == 1, bias = dims[5] == 1;
  const int64_t first_run = 2 + (sandwich ? 2 : 0) + (bias ? 1 : 0);
  int64_t at_run = 0;
  at::TensorList runs[4];
  at::IntArrayRef run_kinds[4];
  for (int m = 0; m < 4; ++m) {
    TORCH_CHECK(dims[6 + m] >= 1, "every projection has a run");
    runs[m] = weights.slice(first_run + at_run, dims[6 + m]);
    run_kinds[m] = kinds.slice(at_run, dims[6 + m]);
    at_run += dims[6 + m];
  }
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == first_run + at_run &&
                  static_cast<int64_t>(kinds.size()) == at_run,
              "weights: the norms, the qkv bias, then each projection's runs; kinds: each run's format");
  at::Tensor qkv = project(rms_norm(h, weights[0], eps), runs[0], run_kinds[0]);
  if (bias) qkv = qkv + weights[first_run - 1];
  const at::Tensor qk = interleaved ? rope_interleaved(qkv, cos, sin, heads + kv_heads, d)
                                    : rope_neox(qkv, cos, sin, heads + kv_heads, d);
  const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * d, kv_heads * d).view({t, kv_heads, d});
  k_cache.index_copy_(0, slots, qk.narrow(1, heads, kv_heads));
  v_cache.index_copy_(0, slots, v);
  const at::Tensor o = decode_attention(qk.narrow(1, 0, heads), k_cache, v_cache, pages, ctx, page_size, scale);
  const at::Tensor attn = project(o.view({t, heads * v_cache.size(2)}), runs[1], run_kinds[1]);
  const at::Tensor mid = h + (sandwich ? rms_norm(attn, weights[2], eps) : attn);
  const at::Tensor act = silu_mul(project(rms_norm(mid, weights[1], eps), runs[2], run_kinds[2]));
  const at::Tensor mlp = project(act, runs[3], run_kinds[3]);
  return mid + (sandwich ? rms_norm(mlp, weights[3], eps) : mlp);
}

}  // namespace mlc
