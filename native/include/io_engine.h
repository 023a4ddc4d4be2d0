// I/O engines: move one file range in chunks with several requests in flight.
// The engine owns scheduling and bounce memory; the caller (FileStore) owns
// what happens to each chunk's bytes (bounce copies, checksums) via callbacks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "faults.h"

namespace pfd {

struct Transfer {
    int fd = -1;
    bool write = false;
    uint64_t file_base = 0;  // file offset of byte 0 of the range
    size_t total = 0;        // bytes to move (a multiple of 4096 for O_DIRECT)
    size_t chunk = 0;        // bytes per request
    FaultAction fault;       // injected fault, applied to chunk 0
    // Buffer the kernel reads into / writes from for chunk i. `bounce` is an
    // aligned chunk-sized scratch buffer the engine lends; return it when user
    // memory cannot take the I/O directly (for writes, fill it first).
    std::function<char *(size_t i, size_t off, size_t len, char *bounce)> prepare;
    // Chunk i has fully landed in `buf`. Returns a status (0 ok); may set detail.
    std::function<int(size_t i, size_t off, size_t len, char *buf, std::string &detail)> complete;

    size_t n_chunks() const { return chunk ? (total + chunk - 1) / chunk : 0; }
};

struct TransferResult {
    int status = 0;        // 0, errno, or STATUS_*
    uint64_t offset = 0;   // file offset of the failing request
    std::string detail;    // extra words for the error message
};

class Engine {
  public:
    virtual ~Engine() = default;
    virtual TransferResult run(Transfer &t) = 0;  // blocking; callbacks may run on engine threads
    virtual const char *name() const = 0;
};

std::unique_ptr<Engine> make_thread_engine(int threads, size_t chunk, const char *name);
std::unique_ptr<Engine> make_aio_engine(int queue_depth, size_t chunk);

// Does kernel AIO work on this (O_DIRECT) fd holding >= 4096 bytes? Empty string if yes, else why not.
std::string aio_probe(int fd);
bool aio_available();       // io_setup works at all
bool io_uring_available();  // io_uring_setup works at all

// pread/pwrite until done, EOF or error: bytes moved, or -errno if nothing could be moved.
ssize_t full_io(bool write, int fd, char *buf, size_t len, uint64_t off);
// Fault hook shared by engines: adjust the result of chunk i.
void apply_fault(const Transfer &t, size_t i, ssize_t &res, size_t len);

}  // namespace pfd
