// One Llama, GLM, GLM-4-0414 or GLM-4.5 (MoE) decoder layer for a step of decode tokens, as one op: the eager layer's
// own kernels (rms_norm, the gguf kernel, rope_neox or rope_interleaved, decode_attention, silu_mul; for a MoE block
// the router's and experts' ATen ops) called in the eager order on the same tensors, so the result is bit for bit the
// eager layer's. What it saves is the forty-odd Python calls and op dispatches between them, a quarter of a decode step
// on the default model (ARCHITECTURE.md, "Defaults and speed"; models/fused_decode.py decides when a layer qualifies).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
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

// layers/moe.TopkRouter._limit_groups: the experts outside each token's `topk_group` best groups (a group scoring
// the sum of its two best) masked with -inf
at::Tensor limit_groups(const at::Tensor& choice, int64_t n_group, int64_t topk_group) {
  const at::Tensor grouped = choice.view({choice.size(0), n_group, -1});
  const at::Tensor group_scores =
      std::get<0>(grouped.topk(std::min<int64_t>(2, grouped.size(-1)), -1)).sum(-1);
  const at::Tensor best = std::get<1>(group_scores.topk(topk_group, -1, true, false));
  const at::Tensor keep = at::zeros_like(group_scores, group_scores.options().dtype(at::kBool)).scatter_(1, best, true);
  return grouped.masked_fill(keep.logical_not().unsqueeze(2), -std::numeric_limits<double>::infinity())
      .view_as(choice);
}

// layers/moe.SparseMoeBlock's routed part, op for op: TopkRouter, then dispatch_experts over QuantizedExperts
// (ascending expert order, each expert on its tokens, weighted outputs cast to x's dtype and index-added).
// experts: the router's weight and correction bias, then each expert's gate|up tiles, then each one's down tiles;
// moe: top_k, n_group, topk_group, norm_topk_prob, a shared expert, the gate|up format, the down format.
at::Tensor routed_experts(const at::Tensor& x, at::TensorList experts, at::IntArrayRef moe, double routed_scale) {
  const int64_t top_k = moe[0], n_group = moe[1], topk_group = moe[2];
  const int64_t n = (static_cast<int64_t>(experts.size()) - 2) / 2;
  const at::Tensor scores = at::linear(x.to(at::kFloat), experts[0].to(at::kFloat)).sigmoid();
  at::Tensor choice = scores + experts[1].to(at::kFloat);
  if (n_group > 1) choice = limit_groups(choice, n_group, topk_group);
  const at::Tensor ids = std::get<1>(choice.topk(top_k, -1, true, false));
  at::Tensor weights = scores.gather(1, ids);
  if (moe[3]) weights = weights / (weights.sum(-1, true) + 1e-20);
  weights = weights * routed_scale;
  const at::Tensor flat = ids.flatten();
  const at::Tensor order = at::argsort(flat, /*stable=*/true, /*dim=*/-1, /*descending=*/false);
  const at::Tensor counts = at::bincount(flat, {}, n).contiguous();
  const int64_t* count = counts.data_ptr<int64_t>();
  const at::Tensor flat_weights = weights.flatten();
  at::Tensor out = at::zeros_like(x);
  int64_t start = 0;
  for (int64_t e = 0; e < n; ++e) {
    if (!count[e]) continue;
    const at::Tensor picks = order.narrow(0, start, count[e]);
    start += count[e];
    const at::Tensor tokens = at::floor_divide(picks, top_k);
    const auto gate_up = mlc::gguf_linear(x.index({tokens}), experts[2 + e], moe[5]).chunk(2, -1);
    const at::Tensor y = mlc::gguf_linear(at::silu(gate_up[0]) * gate_up[1], experts[2 + n + e], moe[6]);
    out.index_add_(0, tokens, (y * flat_weights.index({picks}).unsqueeze(1)).to(out.scalar_type()));
  }
  return out;
}

}  // namespace

namespace mlc {

// dims: heads, kv heads, head_dim, rope over cos's width (0: half-split, 1: GLM's interleaved pairs), sandwich norms
// (GLM-4-0414: a norm on the attention and the MLP outputs before each residual add), a qkv bias, then the runs of qkv,
// o, gate|up and down (a MoE layer's shared expert; none without one). weights: the input and post-attention norms, the
// two sandwich norms where there are, the qkv bias where there is, then every run's packed tiles. A MoE layer (GLM-4.5)
// passes its routed experts and router (`routed_experts`).
at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                        at::IntArrayRef kinds, at::IntArrayRef dims, double eps, double scale,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                        const at::Tensor& pages, const at::Tensor& ctx, int64_t page_size, at::TensorList experts,
                        at::IntArrayRef moe, double routed_scale) {
  TORCH_CHECK(moe.empty() ? experts.empty() : moe.size() == 7 && experts.size() >= 4 && experts.size() % 2 == 0,
              "moe: top_k, n_group, topk_group, norm_topk_prob, shared, the experts' two formats; experts: router "
              "weight and bias, then gate|up and down tiles of each expert");
  const bool routed = !moe.empty(), shared = routed ? moe[4] == 1 : true;
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
    TORCH_CHECK(dims[6 + m] >= (m < 2 || shared ? 1 : 0), "every projection has a run");
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
  const at::Tensor x = rms_norm(mid, weights[1], eps);
  at::Tensor mlp;
  if (routed) mlp = routed_experts(x, experts, moe, routed_scale);
  if (shared) {
    const at::Tensor dense = project(silu_mul(project(x, runs[2], run_kinds[2])), runs[3], run_kinds[3]);
    mlp = routed ? mlp + dense : dense;
  }
  return mid + (sandwich ? rms_norm(mlp, weights[3], eps) : mlp);
}

}  // namespace mlc
