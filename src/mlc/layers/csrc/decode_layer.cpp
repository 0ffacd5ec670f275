// One Llama decoder layer for a step of decode tokens, as one op: the eager layer's own kernels (rms_norm, the gguf
// kernel, rope_neox, decode_attention, silu_mul) called in the eager order on the same tensors, so the result is
// bit for bit the eager layer's. What it saves is the forty-odd Python calls and op dispatches between them, a quarter
// of a decode step on the default model (ARCHITECTURE.md, "Defaults and speed"; models/fused_decode.py decides
// when a layer qualifies).
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

at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                        at::IntArrayRef kinds, at::IntArrayRef dims, double eps, double scale,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                        const at::Tensor& pages, const at::Tensor& ctx, int64_t page_size) {
  TORCH_CHECK(dims.size() == 7, "dims: heads, kv heads, head_dim, then the runs of qkv, o, gate|up and down");
  TORCH_CHECK(h.dim() == 2, "h must be [T, hidden]");
  const int64_t t = h.size(0), heads = dims[0], kv_heads = dims[1], d = dims[2];
  int64_t at_run = 0;
  at::TensorList runs[4];
  at::IntArrayRef run_kinds[4];
  for (int m = 0; m < 4; ++m) {
    TORCH_CHECK(dims[3 + m] >= 1, "every projection has a run");
    runs[m] = weights.slice(2 + at_run, dims[3 + m]);
    run_kinds[m] = kinds.slice(at_run, dims[3 + m]);
    at_run += dims[3 + m];
  }
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 2 + at_run && static_cast<int64_t>(kinds.size()) == at_run,
              "weights: the two norms, then each projection's runs; kinds: each run's format");
  const at::Tensor qkv = project(rms_norm(h, weights[0], eps), runs[0], run_kinds[0]);
  const at::Tensor qk = rope_neox(qkv, cos, sin, heads + kv_heads, d);
  const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * d, kv_heads * d).view({t, kv_heads, d});
  k_cache.index_copy_(0, slots, qk.narrow(1, heads, kv_heads));
  v_cache.index_copy_(0, slots, v);
  const at::Tensor o = decode_attention(qk.narrow(1, 0, heads), k_cache, v_cache, pages, ctx, page_size, scale);
  const at::Tensor mid = h + project(o.view({t, heads * v_cache.size(2)}), runs[1], run_kinds[1]);
  const at::Tensor act = silu_mul(project(rms_norm(mid, weights[1], eps), runs[2], run_kinds[2]));
  return mid + project(act, runs[3], run_kinds[3]);
}

}  // namespace mlc
