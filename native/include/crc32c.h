// CRC-32C (Castagnoli), zlib-style convention: crc32c(data, seed) where seed is
// a previous result, so crc32c(b, crc32c(a)) == crc32c(a + b).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pfd {

uint32_t crc32c(const void *data, size_t n, uint32_t seed = 0);
uint32_t crc32c_table(const void *data, size_t n, uint32_t seed = 0);  // always the portable path
// crc of A+B from crc(A), crc(B) and len(B), without touching the data.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2);
const char *crc32c_impl();  // "sse4.2" | "table"

}  // namespace pfd
