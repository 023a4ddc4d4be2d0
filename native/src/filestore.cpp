// FileStore: naming, header encoding, open (engine probe) and close, index
// queries and commit. Reads/writes: filestore_io.cpp; directory lock and
// recovery: filestore_recovery.cpp.
#include "filestore.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "common.h"
#include "crc32c.h"
#include "filestore_format.h"
#include "memory.h"

namespace pfd {

using namespace fmt;

std::string fmt::encode_header(const Entry &e) {
    std::string b(e.header_size, '\0');
    memcpy(&b[0], kMagic, 4);
    put<uint32_t>(b, 4, kFormat);
    put<uint32_t>(b, 8, uint32_t(e.header_size));
    put<uint32_t>(b, 12, uint32_t(e.key.size()));
    put<uint64_t>(b, 16, e.nbytes);
    put<uint64_t>(b, 24, e.version);
    put<uint64_t>(b, 32, e.extent_size);
    put<uint32_t>(b, 40, uint32_t(e.crcs.size()));
    put<uint32_t>(b, 44, uint32_t(e.meta.size()));
    put<uint32_t>(b, 48, e.data_crc);
    size_t at = kFixed;
    memcpy(&b[at], e.key.data(), e.key.size());
    at += e.key.size();
    memcpy(&b[at], e.meta.data(), e.meta.size());
    at += e.meta.size();
    if (!e.crcs.empty()) memcpy(&b[at], e.crcs.data(), 4 * e.crcs.size());
    at += 4 * e.crcs.size();
    put<uint32_t>(b, at, crc32c(b.data(), at));
    return b;
}

void check_key(const std::string &key) {
    if (key.empty() || key.size() > kMaxKeyBytes)
        throw Error(ErrKind::Value, "key is " + std::to_string(key.size()) + " bytes; a store key must be 1.." +
                                        std::to_string(kMaxKeyBytes) + " bytes of UTF-8 (MAX_KEY_BYTES)");
}

// ---------------------------------------------------------------- naming

std::string FileStore::stem_for(const std::string &key) {
    // Readable prefix + 128-bit CRC-based hash: safe on any filesystem, and
    // collisions are harmless anyway because versions are unique store-wide.
    std::string prefix;
    for (unsigned char c : key) {
        if (prefix.size() >= 40) break;
        prefix += (isalnum(c) || c == '_' || c == '-') ? char(c) : '_';
    }
    char hex[40];
    for (int i = 0; i < 4; i++)
        snprintf(hex + 8 * i, 9, "%08x", crc32c(key.data(), key.size(), 0x9E3779B9u * uint32_t(i + 1)));
    return prefix + "-" + std::string(hex, 32);
}

std::string FileStore::path_for(const std::string &key, uint64_t version, const char *ext) const {
    char v[24];
    snprintf(v, sizeof v, "%016llx", static_cast<unsigned long long>(version));
    return dir_ + "/" + stem_for(key) + "." + v + ext;
}

// ---------------------------------------------------------------- lifecycle

FileStore::FileStore(const std::string &directory, const StoreOptions &opt) : dir_(directory), opt_(opt) {
    while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
    if (opt_.block_size == 0 || opt_.block_size % kDirectAlign)
        throw Error(ErrKind::Value, "block_size must be a positive multiple of 4096");
    if (opt_.extent_size == 0) throw Error(ErrKind::Value, "extent_size must be positive");
    if (opt_.queue_depth < 1 || opt_.io_threads < 1) throw Error(ErrKind::Value, "queue_depth and io_threads must be >= 1");
    const std::string &en = opt_.engine;
    if (en != "auto" && en != "aio" && en != "threads" && en != "buffered")
        throw Error(ErrKind::Value, "engine must be auto|aio|threads|buffered, got '" + en + "'");
    // 0700: weights are nobody else's business (an existing directory keeps its mode; files are 0600 anyway).
    if (mkdir(dir_.c_str(), 0700) == 0) created_dir_ = true;
    else if (errno != EEXIST)
        throw Error(ErrKind::IOFailure, "cannot create store directory " + dir_ + ": " + errno_name(errno), errno);
    dir_fd_ = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd_ < 0) {
        int err = errno;
        if (created_dir_) rmdir(dir_.c_str());
        throw Error(ErrKind::IOFailure, "cannot open store directory " + dir_ + ": " + errno_name(err), err);
    }
    try {
        lock_directory();
        probe();
        recovery_ = recover(opt_.verify_data_on_open);
    } catch (...) {
        engine_.reset();
        release_directory(true);
        throw;
    }
    spare_fds_.reset(new FdReserve(kSpareFds));
}

FileStore::~FileStore() { close(); }

void FileStore::close() {
    if (closed_.exchange(true)) return;
    {
        std::unique_lock<std::mutex> g(ops_mu_);
        ops_cv_.wait(g, [&] { return active_ops_ == 0; });
    }
    engine_.reset();  // joins engine threads, destroys io contexts
    if (spare_fds_) spare_fds_->release_all();
    release_directory(false);
}

void FileStore::check_open() const {
    if (closed_.load()) throw Error(ErrKind::Closed, "store is closed: " + dir_);
}

FileStore::OpGuard::OpGuard(FileStore &st) : s(st) {
    std::lock_guard<std::mutex> g(s.ops_mu_);
    s.check_open();  // under ops_mu_: close() cannot slip in between
    s.active_ops_++;
}
FileStore::OpGuard::~OpGuard() {
    std::lock_guard<std::mutex> g(s.ops_mu_);
    if (--s.active_ops_ == 0) s.ops_cv_.notify_all();
}

void FileStore::probe() {
    // A plain file first: an unwritable directory is an error now, not at the first write-back.
    const std::string scratch = std::string(kProbePrefix) + std::to_string(getpid()) + "-" +
                                std::to_string(reinterpret_cast<uintptr_t>(this));
    int fd = openat(dir_fd_, scratch.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        int err = errno;
        throw Error(ErrKind::IOFailure, "store directory " + dir_ + " is not writable: creating a file there failed: " +
                                            errno_name(err), err);
    }
    ::close(fd);
    struct ScratchRemover {
        int dfd;
        const std::string &name;
        ~ScratchRemover() { unlinkat(dfd, name.c_str(), 0); }
    } remover{dir_fd_, scratch};

    const std::string &want = opt_.engine;
    std::string name;
    if (want == "buffered" || !opt_.direct) {
        direct_ = false;
        name = (want == "auto") ? "buffered" : want;
        probe_report_ = want + ": direct=False requested -> " + name + " (page cache)";
    } else {
        fd = openat(dir_fd_, scratch.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
        std::string why;
        if (fd < 0) {
            why = "O_DIRECT open failed (" + errno_name(errno) + ")";
        } else {
            Mapping buf(kDirectAlign, kDirectAlign);
            if (pwrite(fd, buf.base, kDirectAlign, 0) != ssize_t(kDirectAlign))
                why = "O_DIRECT write failed (" + errno_name(errno) + ")";
        }
        if (!why.empty()) {
            direct_ = false;
            name = "buffered";
            probe_report_ = want + ": " + why + " on " + dir_ + " -> buffered";
        } else {
            direct_ = true;
            std::string aio_why = (want == "auto" || want == "aio") ? aio_probe(fd) : "not requested";
            if (want != "threads" && aio_why.empty()) {
                name = "aio";
                probe_report_ = want + ": O_DIRECT ok on " + dir_ + "; kernel AIO ok -> aio";
            } else {
                name = "threads";
                probe_report_ = want + ": O_DIRECT ok on " + dir_ + "; kernel AIO " +
                                (want == "threads" ? std::string("not requested") : "unusable (" + aio_why + ")") +
                                " -> threads";
            }
        }
        if (fd >= 0) ::close(fd);
    }
    engine_name_ = name;
    if (name == "aio") {
        engine_ = make_aio_engine(opt_.queue_depth, opt_.block_size);
        probe_report_ += " (block_size " + std::to_string(opt_.block_size) + ", queue_depth " +
                         std::to_string(opt_.queue_depth) + ")";
    } else {
        engine_ = make_thread_engine(opt_.io_threads, opt_.block_size, name == "threads" ? "threads" : "buffered");
        probe_report_ += " (block_size " + std::to_string(opt_.block_size) + ", io_threads " +
                         std::to_string(opt_.io_threads) + ")";
    }
}

// ---------------------------------------------------------------- queries

void fmt::not_found(const std::string &key) {
    throw Error(ErrKind::NotFound, "key not found: '" + key + "'", STATUS_NOT_FOUND);
}

std::vector<std::string> FileStore::keys() const {
    check_open();  // the index of a closed store is stale: refuse, as reads do
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::string> k;
    for (auto &kv : index_) k.push_back(kv.first);
    return k;
}

bool FileStore::contains(const std::string &key) const {
    check_key(key);
    check_open();
    std::lock_guard<std::mutex> g(mu_);
    return index_.count(key) != 0;
}

std::shared_ptr<const Entry> FileStore::info(const std::string &key) const { return slot(key).current; }

Slot FileStore::slot(const std::string &key) const {
    check_key(key);
    check_open();
    std::lock_guard<std::mutex> g(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) not_found(key);
    return it->second;
}

bool FileStore::commit(const std::string &key, uint64_t version) {
    check_key(key);
    OpGuard guard(*this);
    std::lock_guard<std::mutex> g(mu_);
    if (!index_.count(key)) not_found(key);
    return commit_locked(key, version);
}

bool FileStore::commit_locked(const std::string &key, uint64_t version) {
    auto it = index_.find(key);
    if (it == index_.end() || it->second.current->version != version) return false;
    Slot &s = it->second;
    s.verified = true;
    if (s.fallback) {
        unlink(s.fallback->path.c_str());
        s.fallback.reset();
        fsync_dir();
    }
    return true;
}

void FileStore::remove(const std::string &key) {
    check_key(key);
    OpGuard guard(*this);
    std::lock_guard<std::mutex> g(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) not_found(key);
    unlink(it->second.current->path.c_str());
    if (it->second.fallback) unlink(it->second.fallback->path.c_str());
    index_.erase(it);
    fsync_dir();
}

uint64_t FileStore::bytes_stored() const {
    check_open();
    std::lock_guard<std::mutex> g(mu_);
    uint64_t n = 0;
    for (auto &kv : index_) n += kv.second.current->nbytes;
    return n;
}

void FileStore::fsync_dir() {
    if (opt_.fsync && dir_fd_ >= 0) fsync(dir_fd_);
}

}  // namespace pfd
