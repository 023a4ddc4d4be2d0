// A few descriptors a FileStore holds open on /dev/null, so that the files it must open are
// not refused at the process's RLIMIT_NOFILE when something else took the rest of the table
// (a flood of connections the control plane accepts faster than it drops them). An open that
// fails with EMFILE/ENFILE closes one of them and tries again; with none left it retries with
// a short backoff (the control plane sheds connections within milliseconds) up to a bound.
// Refilled before every open, while descriptors are to be had.
#pragma once

#include <cerrno>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace pfd {

class FdReserve {
  public:
    explicit FdReserve(size_t size) : size_(size) { refill(); }
    ~FdReserve() { release_all(); }
    FdReserve(const FdReserve &) = delete;
    FdReserve &operator=(const FdReserve &) = delete;

    // `open_fn()` returns a descriptor, or -1 with errno set. Returns its first success, its
    // first failure other than EMFILE/ENFILE, or -1/EMFILE after `wait_ms`.
    template <class F>
    int open(F open_fn, int wait_ms = 2000) {
        refill();
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
        int backoff_us = 200;
        for (;;) {
            int fd = open_fn();
            if (fd >= 0 || (errno != EMFILE && errno != ENFILE)) return fd;
            if (give_back()) continue;
            if (std::chrono::steady_clock::now() >= deadline) {
                errno = EMFILE;
                return -1;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
            backoff_us = std::min(backoff_us * 2, 20000);
        }
    }

    void refill();
    void release_all();
    size_t held();

  private:
    bool give_back();

    std::mutex mu_;
    std::vector<int> fds_;
    size_t size_;
};

}  // namespace pfd
