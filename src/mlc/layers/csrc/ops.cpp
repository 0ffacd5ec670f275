// Every op of the C++ CPU kernels registered in one place, as torch.ops.mlc_kernels.<name> (CPU only). The kernels
// are declared in ops.h and defined in decode_attention.cpp, int4_linear.cpp, int8_linear.cpp, gguf_linear.cpp,
// gguf_pack.cpp, huge_pages.cpp, fused_ops.cpp and decode_layer.cpp.
// Built at run time by mlc/layers/cpu_kernels.py (which also registers the shape-only versions of the GEMMs that
// torch.compile traces).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(mlc_kernels, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor pages, Tensor ctx, int page_size, float scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, int group) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor packed, int kind) -> Tensor");
  m.def("gguf_pack(Tensor raw, int kind, int K) -> Tensor");
  m.def("gguf_rows(Tensor raw, Tensor ids, int kind, int K) -> Tensor");
  m.def("on_huge_pages(Tensor t) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_neox(Tensor qkv, Tensor cos, Tensor sin, int heads, int head_dim) -> Tensor");
  m.def("rope_interleaved(Tensor qkv, Tensor cos, Tensor sin, int heads, int head_dim) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("decode_layer(Tensor h, Tensor cos, Tensor sin, Tensor[] weights, int[] kinds, int[] dims, float eps, "
        "float scale, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor pages, Tensor ctx, int page_size, "
        "Tensor[] experts, int[] moe, float routed_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlc_kernels, CPU, m) {
  m.impl("decode_attention", &mlc::decode_attention);
  m.impl("int4_linear", &mlc::int4_linear);
  m.impl("int8_linear", &mlc::int8_linear);
  m.impl("gguf_linear", &mlc::gguf_linear);
  m.impl("gguf_pack", &mlc::gguf_pack);
  m.impl("gguf_rows", &mlc::gguf_rows);
  m.impl("on_huge_pages", &mlc::on_huge_pages);
  m.impl("rms_norm", &mlc::rms_norm);
  m.impl("rope_neox", &mlc::rope_neox);
  m.impl("rope_interleaved", &mlc::rope_interleaved);
  m.impl("silu_mul", &mlc::silu_mul);
  m.impl("decode_layer", &mlc::decode_layer);
}
