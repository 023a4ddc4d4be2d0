// FileStore internals shared by filestore.cpp and filestore_recovery.cpp: the
// on-disk header layout and file naming. Not part of the Python contract.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"
#include "filestore.h"

namespace pfd {
namespace fmt {

constexpr char kMagic[4] = {'P', 'F', 'D', '1'};
constexpr uint32_t kFormat = 1;
constexpr size_t kFixed = 56;  // fixed header fields before key/meta/crc table
constexpr size_t kMaxMeta = 64 << 10;
// Versions count writes from 1; a header above this one was not written by a FileStore (and
// the next version after it would wrap to 0, older than every file: writes lost).
constexpr uint64_t kMaxVersion = uint64_t(1) << 62;
constexpr const char *kProbePrefix = ".pfd-probe-";

template <class T> void put(std::string &b, size_t at, T v) { memcpy(&b[at], &v, sizeof(T)); }
template <class T> T get(const char *p) {
    T v;
    memcpy(&v, p, sizeof(T));
    return v;
}
inline bool ends_with(const std::string &s, const char *suf) {
    size_t n = strlen(suf);
    return s.size() >= n && s.compare(s.size() - n, n, suf) == 0;
}
inline size_t header_size_for(size_t key, size_t meta, size_t n_ext) {
    return round_up(kFixed + key + meta + 4 * n_ext + 4, kDirectAlign);
}
// (Without nbytes + ext - 1: a header's values are read from disk, and must not wrap.)
inline size_t n_extents(uint64_t nbytes, uint64_t ext) { return ext ? size_t(nbytes / ext + (nbytes % ext != 0)) : 0; }

// Header bytes (padded to its size) for an entry whose crcs are filled in.
std::string encode_header(const Entry &e);
// Error(NotFound) for `key`, the one message every lookup uses.
[[noreturn]] void not_found(const std::string &key);
// The version in "<stem>.<16 hex>.pfd|tmp", 0 if the name has another shape.
uint64_t version_in_name(const std::string &n);

}  // namespace fmt
}  // namespace pfd
