#include "huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

namespace mlc {

// A fresh mapping, never heap memory: glibc serves a large aligned_alloc from its heap once a freed mapping has raised
// its mmap threshold (up to 32 MiB), and pages the heap has touched before stay small whatever madvise says (a 1B
// model's loader left a third of its layers' weights on 4 KiB pages that way, and those streamed at two thirds of
// the rate). Untouched pages of a mapping advised before the first write fault in as 2 MiB pages.
at::Tensor huge_page_bytes(int64_t bytes, const at::TensorOptions& options) {
  constexpr size_t kHuge = 2u << 20;
  if (bytes < static_cast<int64_t>(kHuge)) return at::empty({bytes}, options.dtype(at::kByte));
  const size_t size = (static_cast<size_t>(bytes) + kHuge - 1) / kHuge * kHuge, span = size + kHuge;
  void* base = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return at::empty({bytes}, options.dtype(at::kByte));
  const uintptr_t start = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(uintptr_t{kHuge} - 1);
  void* p = reinterpret_cast<void*>(start);
  madvise(p, size, MADV_HUGEPAGE);  // advice only: where it is refused, small pages serve
  return at::from_blob(p, {bytes}, [base, span](void*) { munmap(base, span); }, options.dtype(at::kByte));
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
