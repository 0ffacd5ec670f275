#include "huge_pages.h"

#include <sys/mman.h>

#include <cstdlib>

#include "ops.h"

namespace mlc {

at::Tensor huge_page_bytes(int64_t bytes, const at::TensorOptions& options) {
  constexpr size_t kHuge = 2u << 20;
  if (bytes < static_cast<int64_t>(kHuge)) return at::empty({bytes}, options.dtype(at::kByte));
  const size_t size = (static_cast<size_t>(bytes) + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, size);
  if (p == nullptr) return at::empty({bytes}, options.dtype(at::kByte));
  madvise(p, size, MADV_HUGEPAGE);  // advice only: where it is refused, small pages serve
  return at::from_blob(p, {bytes}, [](void* q) { std::free(q); }, options.dtype(at::kByte));
}

at::Tensor on_huge_pages(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "on_huge_pages takes a CPU tensor");
  auto src = t.contiguous();
  const int64_t bytes = src.numel() * src.element_size();
  auto out = huge_page_bytes(bytes, src.options());
  std::memcpy(out.data_ptr(), src.data_ptr(), bytes);
  return out.view(src.scalar_type()).view(src.sizes());
}

}  // namespace mlc
