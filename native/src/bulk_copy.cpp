// Streaming-store copies (see bulk_copy.h for why). The destination is aligned
// to a cache line with one memcpy, 64 bytes move per iteration, the tail goes
// through memcpy, and an sfence orders the weakly ordered streaming stores
// before whoever is told the copy is complete.
#include "bulk_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define PFD_X86_64 1
#endif

namespace pfd {
namespace {

constexpr size_t kMin = 256 << 10;  // below this the copy stays in cache: glibc is right
constexpr size_t kLine = 64;

bool overlap(const char *d, const char *s, size_t n) { return d < s + n && s < d + n; }

#ifdef PFD_X86_64
__attribute__((target("avx2"))) void body_avx2(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += kLine) {
        __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s + i));
        __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s + i + 32));
        _mm256_stream_si256(reinterpret_cast<__m256i *>(d + i), a);
        _mm256_stream_si256(reinterpret_cast<__m256i *>(d + i + 32), b);
    }
}

void body_sse2(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += kLine) {
        __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i));
        __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i + 16));
        __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i + 32));
        __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i + 48));
        _mm_stream_si128(reinterpret_cast<__m128i *>(d + i), a);
        _mm_stream_si128(reinterpret_cast<__m128i *>(d + i + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i *>(d + i + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i *>(d + i + 48), e);
    }
}

bool has_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2");
    return yes;
}
#endif

}  // namespace

size_t bulk_copy_min() { return kMin; }

const char *bulk_copy_impl() {
#ifdef PFD_X86_64
    return has_avx2() ? "avx2-stream" : "sse2-stream";
#else
    return "memmove";
#endif
}

void bulk_copy(void *dst, const void *src, size_t n) {
    char *d = static_cast<char *>(dst);
    const char *s = static_cast<const char *>(src);
#ifdef PFD_X86_64
    if (n >= kMin && !overlap(d, s, n)) {
        size_t head = (kLine - (reinterpret_cast<uintptr_t>(d) & (kLine - 1))) & (kLine - 1);
        memcpy(d, s, head);
        size_t body = (n - head) & ~(kLine - 1);
        if (has_avx2()) body_avx2(d + head, s + head, body);
        else body_sse2(d + head, s + head, body);
        _mm_sfence();
        memcpy(d + head + body, s + head + body, n - head - body);
        return;
    }
#endif
    memmove(d, s, n);
}

}  // namespace pfd
