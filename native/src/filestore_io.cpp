// FileStore transfers: chunked reads verified per extent as they land, and
// crash-safe writes (tmp file, fsync, rename, then the older version's fate).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "common.h"
#include "crc32c.h"
#include "faults.h"
#include "filestore.h"
#include "filestore_format.h"
#include "memory.h"

namespace pfd {

using namespace fmt;

namespace {

// Counts bytes landing per extent; the chunk that completes an extent runs
// `fn(extent)` (checksum or verify) right away, on whichever thread landed it.
class ExtentTracker {
  public:
    ExtentTracker(uint64_t nbytes, uint64_t ext) : nbytes_(nbytes), ext_(ext), n_(n_extents(nbytes, ext)),
                                                   landed_(new std::atomic<uint64_t>[n_]) {
        for (size_t i = 0; i < n_; i++) landed_[i] = 0;
    }
    uint64_t extent_len(size_t e) const { return std::min(ext_, nbytes_ - e * ext_); }
    template <class F> int land(uint64_t off, uint64_t len, F fn) {
        uint64_t end = std::min(off + len, nbytes_);
        if (off >= end) return 0;
        for (size_t e = size_t(off / ext_); e <= size_t((end - 1) / ext_); e++) {
            uint64_t lo = std::max(off, e * ext_), hi = std::min(end, (e + 1) * ext_);
            uint64_t want = extent_len(e);
            if (landed_[e].fetch_add(hi - lo) + (hi - lo) == want) {
                int st = fn(e);
                if (st != 0) return st;
            }
        }
        return 0;
    }

  private:
    uint64_t nbytes_, ext_;
    size_t n_;
    std::unique_ptr<std::atomic<uint64_t>[]> landed_;
};

std::string hex32(uint32_t v) {
    char b[16];
    snprintf(b, sizeof b, "0x%08x", v);
    return b;
}

void sleep_ms(int ms) {
    if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

}  // namespace

// ---------------------------------------------------------------- read

size_t FileStore::read(const std::string &key, MemRef dst, bool verify) {
    check_key(key);
    OpGuard guard(*this);
    FaultAction fault = check_fault("read", key);
    if (fault.kind == FaultKind::Delay) sleep_ms(fault.delay_ms);

    std::shared_ptr<const Entry> e;
    int fd;
    {
        // Open under the index lock: a concurrent write may unlink this version
        // right after, but our descriptor keeps the data readable.
        std::lock_guard<std::mutex> g(mu_);
        auto it = index_.find(key);
        if (it == index_.end()) not_found(key);
        e = it->second.current;
        // O_NONBLOCK: a FIFO put where the file was would block this open, under mu_, until a
        // writer came (every caller asking about the store waited with it); it is refused
        // below instead, as recovery quarantines one. (No effect on a regular file's reads.)
        const int flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | (direct_ ? O_DIRECT : 0);
        fd = spare_fds_->open([&] { return ::open(e->path.c_str(), flags); });
        if (fd < 0) {
            int err = errno;
            throw Error(ErrKind::IOFailure, "read failed: key '" + key + "': open: " + errno_name(err) + " (" + e->path + ")", err);
        }
        struct stat st;
        if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
            ::close(fd);
            throw Error(ErrKind::IOFailure, "read failed: key '" + key + "': " + e->path +
                                                " is no longer a regular file (replaced since the store opened it)", EIO);
        }
        // Blocking again: an io_uring read of an O_NONBLOCK file would fail with EAGAIN.
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    }
    struct FdCloser { int fd; ~FdCloser() { ::close(fd); } } closer{fd};
    if (dst.len < e->nbytes)
        throw Error(ErrKind::Value, "read: key '" + key + "' holds " + std::to_string(e->nbytes) +
                                        " bytes, destination only " + std::to_string(dst.len));

    ExtentTracker tracker(e->nbytes, e->extent_size);
    const bool dst_direct = !direct_ || is_aligned(dst.ptr, kDirectAlign);
    Transfer t;
    t.fd = fd;
    t.write = false;
    t.file_base = e->header_size;
    t.total = round_up(e->nbytes, kDirectAlign);
    t.chunk = opt_.block_size;
    t.fault = fault;
    t.prepare = [&](size_t, size_t off, size_t len, char *bounce) -> char * {
        return (dst_direct && off + len <= dst.capacity) ? dst.ptr + off : bounce;
    };
    t.complete = [&](size_t i, size_t off, size_t len, char *buf, std::string &detail) -> int {
        size_t valid = size_t(std::min<uint64_t>(len, e->nbytes - std::min<uint64_t>(off, e->nbytes)));
        if (buf != dst.ptr + off && valid) memcpy(dst.ptr + off, buf, valid);
        if (i == 0 && fault.kind == FaultKind::Bitflip && e->nbytes) dst.ptr[0] ^= 0x10;
        if (!verify) return 0;
        return tracker.land(off, len, [&](size_t x) -> int {
            uint64_t xo = x * e->extent_size;
            uint32_t c = crc32c(dst.ptr + xo, size_t(tracker.extent_len(x)));
            if (c == e->crcs[x]) return 0;
            detail = "extent " + std::to_string(x) + " of " + std::to_string(e->crcs.size()) + " (stored " +
                     hex32(e->crcs[x]) + ", computed " + hex32(c) + ")";
            return STATUS_CHECKSUM;
        });
    };
    TransferResult r = engine_->run(t);
    if (r.status == STATUS_CHECKSUM)
        throw Error(ErrKind::Checksum, "checksum mismatch: key '" + key + "': " + r.detail + " in " + e->path,
                    STATUS_CHECKSUM);
    if (r.status != 0)
        throw Error(ErrKind::IOFailure,
                    "read failed: key '" + key + "': " + (r.status > 0 ? errno_name(r.status) : r.detail) +
                        " at offset " + std::to_string(r.offset) + " (" + e->path + ")" +
                        (fault.kind != FaultKind::None ? " [injected]" : ""),
                    r.status);
    if (verify) {  // every extent matched: this version is known good, its fallback can go
        std::lock_guard<std::mutex> g(mu_);
        commit_locked(key, e->version);
    }
    return size_t(e->nbytes);
}

// ---------------------------------------------------------------- write

uint64_t FileStore::write(const std::string &key, MemRef src, const std::string &meta) {
    check_key(key);
    OpGuard guard(*this);
    if (meta.size() > kMaxMeta) throw Error(ErrKind::Value, "meta must be at most 64 KiB");
    FaultAction fault = check_fault("write", key);
    if (fault.kind == FaultKind::Delay) sleep_ms(fault.delay_ms);

    Entry e;
    e.key = key;
    e.version = next_version_++;
    e.nbytes = src.len;
    e.extent_size = opt_.extent_size;
    e.crcs.assign(n_extents(e.nbytes, e.extent_size), 0);
    e.meta = meta;
    e.header_size = header_size_for(key.size(), meta.size(), e.crcs.size());
    e.path = path_for(key, e.version, ".pfd");
    const std::string tmp = path_for(key, e.version, ".tmp");

    {
        std::lock_guard<std::mutex> g(mu_);
        writing_.insert(tmp);
    }
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct_ ? O_DIRECT : 0);
    int fd = spare_fds_->open([&] { return ::open(tmp.c_str(), flags, 0600); });
    int err = fd < 0 ? errno : 0;
    std::string what = fd < 0 ? "open" : "";
    TransferResult r;

    auto fail = [&](int status, const std::string &how) {
        if (fd >= 0) ::close(fd);
        unlink(tmp.c_str());  // the previous version was never touched
        {
            std::lock_guard<std::mutex> g(mu_);
            writing_.erase(tmp);
        }
        throw Error(ErrKind::IOFailure,
                    "write failed: key '" + key + "': " + how + (fault.kind != FaultKind::None ? " [injected]" : ""),
                    status);
    };
    if (fd < 0) fail(err, "open: " + errno_name(err) + " (" + tmp + ")");

    ExtentTracker tracker(e.nbytes, e.extent_size);
    const bool src_direct = !direct_ || is_aligned(src.ptr, kDirectAlign);
    Transfer t;
    t.fd = fd;
    t.write = true;
    t.file_base = e.header_size;
    t.total = round_up(e.nbytes, kDirectAlign);
    t.chunk = opt_.block_size;
    t.fault = fault;
    t.prepare = [&](size_t, size_t off, size_t len, char *bounce) -> char * {
        if (src_direct && off + len <= src.capacity) return src.ptr + off;
        size_t valid = size_t(std::min<uint64_t>(len, e.nbytes - off));
        memcpy(bounce, src.ptr + off, valid);
        memset(bounce + valid, 0, len - valid);  // file padding is zeros
        return bounce;
    };
    t.complete = [&](size_t, size_t off, size_t len, char *, std::string &) -> int {
        return tracker.land(off, len, [&](size_t x) {
            e.crcs[x] = crc32c(src.ptr + x * e.extent_size, size_t(tracker.extent_len(x)));
            return 0;
        });
    };
    r = engine_->run(t);
    if (r.status != 0)
        fail(r.status, (r.status > 0 ? errno_name(r.status) : r.detail) + " at offset " + std::to_string(r.offset) +
                           " (" + tmp + ")");

    // Whole-data CRC from the extent CRCs: no second pass over the data.
    uint32_t whole = 0;
    for (size_t x = 0; x < e.crcs.size(); x++)
        whole = crc32c_combine(whole, e.crcs[x], size_t(tracker.extent_len(x)));
    e.data_crc = whole;

    std::string hdr = encode_header(e);
    Mapping hbuf(hdr.size(), kDirectAlign);  // O_DIRECT wants aligned memory
    memcpy(hbuf.base, hdr.data(), hdr.size());
    ssize_t w = full_io(true, fd, hbuf.base, hdr.size(), 0);
    if (w < 0) fail(int(-w), "header: " + errno_name(int(-w)) + " (" + tmp + ")");
    if (size_t(w) < hdr.size()) fail(STATUS_SHORT_READ, "header: short write (" + tmp + ")");
    if (opt_.fsync && fsync(fd) != 0) fail(errno, "fsync: " + errno_name(errno) + " (" + tmp + ")");
    int fd_to_close = fd;
    fd = -1;
    if (::close(fd_to_close) != 0) fail(errno, "close: " + errno_name(errno) + " (" + tmp + ")");
    if (rename(tmp.c_str(), e.path.c_str()) != 0) fail(errno, "rename: " + errno_name(errno) + " (" + tmp + ")");

    std::lock_guard<std::mutex> g(mu_);
    writing_.erase(tmp);
    fsync_dir();  // the rename is durable before any older version goes
    const uint64_t version = e.version;
    auto fresh = std::make_shared<const Entry>(std::move(e));
    Slot &slot = index_[key];
    if (slot.current && slot.current->version >= version) {
        // A newer concurrent write already won (or a runtime recover() indexed this very file).
        if (slot.current->version > version) unlink(fresh->path.c_str());
        return version;
    }
    // The previous version stays as the fallback only if it was known good;
    // an unverified one that is superseded is just deleted (the known-good
    // fallback before it, if any, stays).
    if (slot.current && slot.verified) {
        if (slot.fallback) unlink(slot.fallback->path.c_str());
        slot.fallback = slot.current;
    } else if (slot.current) {
        unlink(slot.current->path.c_str());
    }
    slot.current = fresh;
    slot.verified = false;
    return version;
}

}  // namespace pfd
