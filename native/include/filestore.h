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

// What open/recover did (API.md recovery_report).
struct RecoveryReport {
    long kept = 0;
    std::vector<std::string> removed_tmp;
    long removed_old = 0;
    std::vector<std::string> removed_corrupt;
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

// A caller's memory for one transfer: `len` bytes usable, `capacity` >= len
// bytes safe to touch (Blocks expose their aligned capacity here).
struct MemRef {
    char *ptr = nullptr;
    size_t len = 0;
    size_t capacity = 0;
};

class FileStore {
  public:
    FileStore(const std::string &directory, const StoreOptions &opt);
    ~FileStore();

    size_t read(const std::string &key, MemRef dst, bool verify);  // bytes read; throws Error
    uint64_t write(const std::string &key, MemRef src, const std::string &meta);  // new version
    std::vector<std::string> keys() const;
    bool contains(const std::string &key) const;
    std::shared_ptr<const Entry> info(const std::string &key) const;  // NotFound
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
    std::shared_ptr<Entry> parse_file(const std::string &path, std::string &why) const;
    bool verify_file(const Entry &e, std::string &why) const;
    std::string path_for(const std::string &key, uint64_t version, const char *ext) const;
    void fsync_dir();

    std::string dir_;
    StoreOptions opt_;
    bool direct_ = true;
    std::string engine_name_, probe_report_;
    std::unique_ptr<Engine> engine_;
    RecoveryReport recovery_;
    int dir_fd_ = -1;

    mutable std::mutex mu_;  // guards index_ and the file set on disk
    std::map<std::string, std::shared_ptr<const Entry>> index_;
    std::set<std::string> writing_;  // .tmp paths of writes in progress (recover() must not delete them)
    std::atomic<uint64_t> next_version_{1};

    std::atomic<bool> closed_{false};
    std::mutex ops_mu_;
    std::condition_variable ops_cv_;
    long active_ops_ = 0;
};

}  // namespace pfd
