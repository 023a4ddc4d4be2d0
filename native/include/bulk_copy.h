// Copies of whole tensors (KiBs to GiBs) between the host pool and the arena.
#pragma once

#include <cstddef>

namespace pfd {

// memmove(dst, src, n), with streaming (non-temporal) stores on x86-64 when the
// ranges do not overlap and n is at least bulk_copy_min(). Why not leave it to
// glibc: glibc switches to non-temporal stores only above
// x86_non_temporal_threshold, 3/4 of the L3 size CPUID reports. A VM that
// reports a 256 MiB L3 gets 192 MiB, so every 64 MiB tensor went through
// `rep movsb` into the cache: 0.20 s per GiB against 0.11 s with streaming
// stores, measured on such a VM (docs/performance.md). A tensor copied to the
// device is read next by compute, long after the cache has turned over, so
// keeping it in the cache buys nothing; the stores also skip the
// read-for-ownership of every destination line.
void bulk_copy(void *dst, const void *src, size_t n);
size_t bulk_copy_min();
const char *bulk_copy_impl();  // "avx2-stream" | "sse2-stream" | "memmove"

}  // namespace pfd
