// CRC-32C: SSE4.2 crc32 instruction over three interleaved lanes (hides the
// instruction's 3-cycle latency), combined with a GF(2) multiply; portable
// slicing-by-8 tables when the CPU lacks SSE4.2.
#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define PFD_X86 1
#endif

namespace pfd {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
    uint32_t t[8][256];
    Tables() {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; i++)
            for (int s = 1; s < 8; s++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
};
const Tables &tables() {
    static const Tables t;
    return t;
}

// Raw register update (no pre/post inversion).
uint32_t table_raw(uint32_t crc, const unsigned char *p, size_t n) {
    const auto &T = tables().t;
    while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
        crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xFF];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = T[7][w & 0xFF] ^ T[6][(w >> 8) & 0xFF] ^ T[5][(w >> 16) & 0xFF] ^ T[4][(w >> 24) & 0xFF] ^
              T[3][(w >> 32) & 0xFF] ^ T[2][(w >> 40) & 0xFF] ^ T[1][(w >> 48) & 0xFF] ^ T[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xFF];
    return crc;
}

// a * b modulo the polynomial, in the reflected bit order (zlib's multmodp).
uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
    }
    return p;
}

// x^(8*n) mod P: the operator "append n zero bytes" on a raw register.
uint32_t xpow8n(size_t n) {
    uint32_t p = 1u << 31;   // x^0
    uint32_t sq = 1u << 23;  // x^8
    while (n) {
        if (n & 1) p = multmodp(sq, p);
        sq = multmodp(sq, sq);
        n >>= 1;
    }
    return p;
}

#ifdef PFD_X86
constexpr size_t kLane = 4096;  // bytes per lane per round (3 lanes => 12 KiB rounds)

__attribute__((target("sse4.2"))) uint32_t sse42_raw(uint32_t crc, const unsigned char *p, size_t n) {
    static const uint32_t k1 = xpow8n(kLane), k2 = xpow8n(2 * kLane);
    while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
        crc = _mm_crc32_u8(crc, *p++);
        n--;
    }
    while (n >= 3 * kLane) {
        uint64_t a = crc, b = 0, c = 0;
        const unsigned char *pa = p, *pb = p + kLane, *pc = p + 2 * kLane;
        for (size_t i = 0; i < kLane; i += 8) {
            uint64_t wa, wb, wc;
            memcpy(&wa, pa + i, 8);
            memcpy(&wb, pb + i, 8);
            memcpy(&wc, pc + i, 8);
            a = _mm_crc32_u64(a, wa);
            b = _mm_crc32_u64(b, wb);
            c = _mm_crc32_u64(c, wc);
        }
        // Linear in the register: shift lane A past B and C, lane B past C.
        crc = multmodp(k2, uint32_t(a)) ^ multmodp(k1, uint32_t(b)) ^ uint32_t(c);
        p += 3 * kLane;
        n -= 3 * kLane;
    }
    uint64_t c64 = crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
        p += 8;
        n -= 8;
    }
    crc = uint32_t(c64);
    while (n--) crc = _mm_crc32_u8(crc, *p++);
    return crc;
}

bool have_sse42() {
    static const bool ok = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("sse4.2") != 0;
    }();
    return ok;
}
#else
bool have_sse42() { return false; }
#endif

}  // namespace

uint32_t crc32c_table(const void *data, size_t n, uint32_t seed) {
    return ~table_raw(~seed, static_cast<const unsigned char *>(data), n);
}

uint32_t crc32c(const void *data, size_t n, uint32_t seed) {
#ifdef PFD_X86
    if (have_sse42()) return ~sse42_raw(~seed, static_cast<const unsigned char *>(data), n);
#endif
    return crc32c_table(data, n, seed);
}

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2) {
    return multmodp(xpow8n(len2), crc1) ^ crc2;
}

const char *crc32c_impl() { return have_sse42() ? "sse4.2" : "table"; }

}  // namespace pfd
