// FileStore: the remote tier. One directory, one crash-safe file per tensor
// version, data verified per extent as it is read back.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common.h"
#include "fd_reserve.h"
#include "io_engine.h"

namespace pfd {

struct StoreOptions {
    std::string engine = "auto";
    bool direct = true;
    // Defaults measured with prefetchd.bench.io on this project's reference VM
    // (1 GiB cold sequential reads, interleaved with fio): aio 8 MiB x 8 in flight
    // was at the top (~2.6 GB/s, 1.8x fio libaio 1M qd8 in the same run); 4 threads
    // is the best pread pool on 2 cores without oversubscribing them.
    size_t block_size = 8 << 20;
    int queue_depth = 8;
    int io_threads = 4;
    size_t extent_size = 1 << 20;
    bool fsync = true;
    bool verify_data_on_open = false;
};

// Longest key (tensor name) a store accepts, in UTF-8 bytes (_native.MAX_KEY_BYTES).
constexpr size_t kMaxKeyBytes = 1024;
// Throws Error(Value) naming the limit unless 1 <= key.size() <= kMaxKeyBytes.
void check_key(const std::string &key);

// Lock file in the store directory: flock'ed for the FileStore's life, holds the owner's pid.
constexpr const char *kLockName = ".pfd-lock";
// Subdirectory where recovery moves files it cannot use (never deletes them).
constexpr const char *kQuarantineDir = "quarantine";

// Another FileStore (this process or another) holds the store directory.
struct StoreInUse : Error {
    long pid;
    StoreInUse(const std::string &msg, long owner) : Error(ErrKind::IOFailure, msg, EBUSY), pid(owner) {}
};

// One file recovery set aside: where it was, where it is now, why.
struct Quarantined {
    std::string path, moved_to, reason;
};

// What open/recover did (API.md recovery_report).
struct RecoveryReport {
    long kept = 0;
    std::vector<std::string> removed_tmp;
    long removed_old = 0;
    std::vector<Quarantined> quarantined;
};

// Everything the header of one version file says.
struct Entry {
    std::string key;
    uint64_t version = 0;
    uint64_t nbytes = 0;
    uint64_t extent_size = 0;
    std::vector<uint32_t> crcs;  // per extent
    std::string meta;
    uint32_t data_crc = 0;  // whole data
    size_t header_size = 0;
    std::string path;
};

// A key's versions the store keeps: the newest (`current`, what reads get)
// and, until `current` is verified, the last version known good.
struct Slot {
    std::shared_ptr<const Entry> current;
    bool verified = false;  // current was read back intact (commit) or is the only copy recovery found
    std::shared_ptr<const Entry> fallback;  // kept on disk until current is verified
};

// A caller's memory for one transfer: `len` bytes usable, `capacity` >= len
// bytes safe to touch (Blocks expose their aligned capacity here).
struct MemRef {
    char *ptr = nullptr;
    size_t len = 0;
    size_t capacity = 0;
};

constexpr size_t kSpareFds = 8;  // descriptors a store holds back for its own opens (fd_reserve.h)

class FileStore {
  public:
    FileStore(const std::string &directory, const StoreOptions &opt);
    ~FileStore();

    size_t read(const std::string &key, MemRef dst, bool verify);  // bytes read; throws Error
    uint64_t write(const std::string &key, MemRef src, const std::string &meta);  // new version
    std::vector<std::string> keys() const;
    bool contains(const std::string &key) const;
    std::shared_ptr<const Entry> info(const std::string &key) const;  // NotFound
    Slot slot(const std::string &key) const;                          // NotFound
    // `version` of `key` is known good: delete the older version kept as its
    // fallback. False if `version` is not the current one (nothing done).
    bool commit(const std::string &key, uint64_t version);
    void remove(const std::string &key);
    uint64_t bytes_stored() const;
    RecoveryReport recover(bool verify_data);
    void close();
    bool closed() const { return closed_.load(); }

    const std::string &directory() const { return dir_; }
    const std::string &engine() const { return engine_name_; }
    bool direct() const { return direct_; }
    const std::string &probe_report() const { return probe_report_; }
    const RecoveryReport &recovery_report() const { return recovery_; }
    const StoreOptions &options() const { return opt_; }

    static std::string stem_for(const std::string &key);

  private:
    void probe();
    void check_open() const;
    // Keep close() waiting while an operation runs.
    struct OpGuard {
        FileStore &s;
        explicit OpGuard(FileStore &st);
        ~OpGuard();
    };
    void lock_directory();
    void release_directory(bool failed_open);
    std::string quarantine(const std::string &name, const std::string &why, RecoveryReport &rep);
    std::shared_ptr<Entry> parse_file(const std::string &name, std::string &why) const;
    bool verify_file(const Entry &e, std::string &why) const;
    bool commit_locked(const std::string &key, uint64_t version);
    std::string path_for(const std::string &key, uint64_t version, const char *ext) const;
    void fsync_dir();

    std::string dir_;
    StoreOptions opt_;
    bool direct_ = true;
    std::string engine_name_, probe_report_;
    std::unique_ptr<Engine> engine_;
    RecoveryReport recovery_;
    int dir_fd_ = -1;
    int lock_fd_ = -1;
    // Spare descriptors for the files reads and writes open (fd_reserve.h): a connection
    // flood at RLIMIT_NOFILE must not fail store I/O. Created after the store opened.
    std::unique_ptr<FdReserve> spare_fds_;
    bool created_dir_ = false, created_lock_ = false;  // undone if open fails

    mutable std::mutex mu_;  // guards index_ and the file set on disk
    std::map<std::string, Slot> index_;
    std::set<std::string> writing_;  // .tmp paths of writes in progress (recover() must not delete them)
    std::atomic<uint64_t> next_version_{1};

    std::atomic<bool> closed_{false};
    std::mutex ops_mu_;
    std::condition_variable ops_cv_;
    long active_ops_ = 0;
};

}  // namespace pfd
