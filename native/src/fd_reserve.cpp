// FdReserve (fd_reserve.h): spare descriptors a FileStore gives back at the descriptor limit.
#include "fd_reserve.h"

#include <fcntl.h>
#include <unistd.h>

namespace pfd {

void FdReserve::refill() {
    std::lock_guard<std::mutex> g(mu_);
    while (fds_.size() < size_) {
        int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (fd < 0) break;  // at the limit now: the next open refills
        fds_.push_back(fd);
    }
}

bool FdReserve::give_back() {
    std::lock_guard<std::mutex> g(mu_);
    if (fds_.empty()) return false;
    ::close(fds_.back());
    fds_.pop_back();
    return true;
}

void FdReserve::release_all() {
    std::lock_guard<std::mutex> g(mu_);
    for (int fd : fds_) ::close(fd);
    fds_.clear();
    size_ = 0;  // closed with its store: no refill
}

size_t FdReserve::held() {
    std::lock_guard<std::mutex> g(mu_);
    return fds_.size();
}

}  // namespace pfd
