#include "huge_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "ops.h"

namespace mlc {

namespace {

constexpr size_t kHuge = 2u << 20;
constexpr size_t kChunk = 256u << 20;  // address space an arena reserves; only the pages written become memory

// Tensors start and end on whole system pages (4 KiB on x86; 16 or 64 KiB on some arm64 and POWER kernels), so
// releasing one tensor's pages never touches a neighbour's bytes
size_t page_size() {
  static const size_t page = std::max<size_t>(4096, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  return page;
}

// One reserved mapping that packed tensors are placed in one after the other. Laid end to end, they share their 2 MiB
// pages: a tensor alone in a mapping of its own rounded up to whole huge pages (its last one filled on first touch)
// cost a 1B model ~100 MB of pages holding nothing, and tensors under 2 MiB (a MoE's experts) fell back to small
// pages. A freed tensor's pages are released (madvise; each tensor starts and ends on pages of its own), the mapping
// when the last tensor in it goes. A tensor over half an arena gets a mapping of its own, leaving the current one.
struct Arena {
  char* base = nullptr;  // 2 MiB aligned
  void* mapped = nullptr;
  size_t span = 0;
  size_t used = 0;
  std::atomic<int64_t> users{1};  // the tensors in it, and the allocator while it is current

  void drop() {
    if (users.fetch_sub(1) == 1) {
      munmap(mapped, span);
      delete this;
    }
  }
};

Arena* new_arena(size_t at_least) {
  const size_t size = std::max(kChunk, (at_least + kHuge - 1) / kHuge * kHuge), span = size + kHuge;
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  auto* arena = new Arena;
  arena->mapped = mapped;
  arena->span = span;
  arena->base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(mapped) + kHuge - 1) & ~(uintptr_t{kHuge} - 1));
  madvise(arena->base, size, MADV_HUGEPAGE);  // advice only: where it is refused, small pages serve
  return arena;
}

std::mutex arena_lock;
Arena* current = nullptr;
size_t current_size = 0;

}  // namespace

// Fresh mappings, never heap memory: glibc serves a large aligned_alloc from its heap once a freed mapping has raised
// its mmap threshold (up to 32 MiB), and pages the heap has touched before stay small whatever madvise says (a 1B
// model's loader left a third of its layers' weights on 4 KiB pages that way, and those streamed at two thirds of
// the rate). Untouched pages of a mapping advised before the first write fault in as 2 MiB pages.
at::Tensor huge_page_bytes(int64_t bytes, const at::TensorOptions& options) {
  const size_t page = page_size();
  if (bytes < static_cast<int64_t>(page)) return at::empty({bytes}, options.dtype(at::kByte));
  const size_t size = (static_cast<size_t>(bytes) + page - 1) / page * page;
  Arena* arena = nullptr;
  char* p = nullptr;
  if (size > kChunk / 2) {  // alone: the arena's one user is this tensor
    arena = new_arena(size);
    if (arena == nullptr) return at::empty({bytes}, options.dtype(at::kByte));
    p = arena->base;
  } else {
    std::lock_guard<std::mutex> hold(arena_lock);
    if (current == nullptr || current->used + size > current_size) {
      Arena* fresh = new_arena(size);
      if (fresh == nullptr) return at::empty({bytes}, options.dtype(at::kByte));
      if (current != nullptr) current->drop();  // full: it lives on as long as its tensors do
      current = fresh;
      current_size = fresh->span - kHuge;
    }
    arena = current;
    p = arena->base + arena->used;
    arena->used += size;
    arena->users.fetch_add(1);
  }
  return at::from_blob(
      p, {bytes},
      [arena, size](void* data) {
        madvise(data, size, MADV_DONTNEED);  // whole pages of its own: no neighbour's bytes among them
        arena->drop();
      },
      options.dtype(at::kByte));
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
