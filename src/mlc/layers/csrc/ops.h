// The ops of the C++ CPU kernels, each defined in the source named beside it; ops.cpp registers them all as
// torch.ops.mlc_kernels.<name>. Built at run time by mlc/layers/cpu_kernels.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace mlc {

// decode_attention.cpp: one query token per sequence over the paged KV cache, read in place through the page table
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
                            const at::Tensor& ctx, int64_t page_size, double scale);

// int4_linear.cpp: y = x W^T from group-wise int4 weights in pack_int4_tiles' layout
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t group);

// int8_linear.cpp: y = x W^T from per-row int8 weights in pack_int8_tiles' layout
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed);

// gguf_linear.cpp: y = x W^T from a GGUF matrix in gguf_pack's tiles (`kind` indexes gguf_blocks.h's formats)
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind);

// gguf_pack.cpp: a GGUF matrix's raw blocks [N, bytes per row] into gguf_linear's tiles, and rows of it as floats
at::Tensor gguf_pack(const at::Tensor& raw, int64_t kind, int64_t K);
at::Tensor gguf_rows(const at::Tensor& raw, const at::Tensor& ids, int64_t kind, int64_t K);

// huge_pages.cpp: a copy of a tensor on 2 MiB pages (packed weights: read once a token, a quarter faster there)
at::Tensor on_huge_pages(const at::Tensor& t);

// fused_ops.cpp: the fused elementwise steps of a decoder layer
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope_neox(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t head_dim);
at::Tensor rope_interleaved(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                            int64_t head_dim);
at::Tensor silu_mul(const at::Tensor& x);

// decode_layer.cpp: a Llama decoder layer over a step of decode tokens, from the ops above in the eager order
at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                        at::IntArrayRef kinds, at::IntArrayRef dims, double eps, double scale,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                        const at::Tensor& pages, const at::Tensor& ctx, int64_t page_size, at::TensorList experts,
                        at::IntArrayRef moe, double routed_scale);

}  // namespace mlc
