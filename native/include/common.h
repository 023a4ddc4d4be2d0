// Shared helpers for the native tier engine: error kinds, status codes, clocks.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <stdexcept>
#include <string>

namespace pfd {

// Status codes carried by completions (API.md): 0 ok, >0 errno, <0 our own.
constexpr int STATUS_OK = 0;
constexpr int STATUS_CHECKSUM = -1;
constexpr int STATUS_SHORT_READ = -2;
constexpr int STATUS_NOT_FOUND = -3;
constexpr int STATUS_CANCELLED = -4;

// One C++ exception type for everything; `kind` selects the Python class when
// module.cpp translates it. Keeping a single type avoids pybind11's
// translator-ordering pitfalls with exception hierarchies.
enum class ErrKind { Native, OutOfSpace, IOFailure, Checksum, NotFound, Closed, Value };

struct Error : std::runtime_error {
    ErrKind kind;
    int status;  // status code equivalent (for completions)
    Error(ErrKind k, const std::string &msg, int st = 0) : std::runtime_error(msg), kind(k), status(st) {}
};

// The status code an error maps to, and the error a status maps to.
int status_of(const Error &e);
ErrKind kind_of_status(int status);

// "EIO", "ENOSPC", ... (falls back to "errno N").
std::string errno_name(int err);

inline int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
inline bool is_aligned(const void *p, size_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

constexpr size_t kDirectAlign = 4096;  // O_DIRECT offset/length/memory alignment we use

// Block until *word >= at_least or timeout seconds pass (<0: no limit); returns *word.
int64_t wait_word(int64_t *word, int64_t at_least, double timeout);

}  // namespace pfd
