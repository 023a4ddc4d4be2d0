// HostPool: exact-budget staging buffers, one aligned mapping per block so
// budget accounting is by requested bytes, never rounded to a power of two.
#include <sys/mman.h>

#include <algorithm>

#include "common.h"
#include "memory.h"

namespace pfd {

HostPoolImpl::HostPoolImpl(size_t budget, size_t alignment, bool lock_memory, bool huge_pages)
    : budget_(budget), alignment_(alignment), lock_(lock_memory), huge_(huge_pages), all_locked_(lock_memory) {
    check_alignment(alignment);
}

std::shared_ptr<Block> HostPoolImpl::alloc(size_t nbytes) {
    {
        std::lock_guard<std::mutex> g(mu_);
        if (closed_) throw Error(ErrKind::Closed, "host pool is closed");
        if (nbytes > budget_ - used_)
            throw Error(ErrKind::OutOfSpace, "host pool cannot fit " + std::to_string(nbytes) + " bytes: used " +
                                                 std::to_string(used_) + " of budget " + std::to_string(budget_));
        used_ += nbytes;  // reserve before mapping so concurrent allocs respect the budget
        peak_ = std::max(peak_, used_);
    }
    std::shared_ptr<Mapping> m;
    bool huge = huge_ && nbytes >= kHugePage;
    try {
        m = std::make_shared<Mapping>(nbytes, huge ? std::max(alignment_, kHugePage) : alignment_);
    } catch (...) {
        std::lock_guard<std::mutex> g(mu_);
        used_ -= nbytes;
        throw;
    }
    // Only the whole huge pages: a partial one at the end would fault in 2 MiB
    // for the tail's few bytes, memory the budget does not count.
    if (huge) {
        m->huge_len = m->len / kHugePage * kHugePage;
        advise_huge_pages(m->base, m->huge_len);
    }
    if (lock_ && nbytes > 0 && mlock(m->base, m->len) != 0) {
        std::lock_guard<std::mutex> g(mu_);
        all_locked_ = false;  // RLIMIT_MEMLOCK: keep going unlocked, report via `locked`
    }
    char *p = m->base;
    return std::make_shared<Block>(std::move(m), shared_from_this(), p, nbytes, round_up(nbytes, alignment_), -1);
}

void HostPoolImpl::give_back(int64_t, size_t, size_t nbytes) {
    // The mapping itself goes when the last view of the Block goes.
    std::lock_guard<std::mutex> g(mu_);
    used_ -= nbytes;
}

void HostPoolImpl::close() {
    std::lock_guard<std::mutex> g(mu_);
    closed_ = true;
}

size_t HostPoolImpl::used() const { std::lock_guard<std::mutex> g(mu_); return used_; }
size_t HostPoolImpl::peak_used() const { std::lock_guard<std::mutex> g(mu_); return peak_; }
bool HostPoolImpl::locked() const { std::lock_guard<std::mutex> g(mu_); return lock_ && all_locked_; }
bool HostPoolImpl::closed() const { std::lock_guard<std::mutex> g(mu_); return closed_; }

}  // namespace pfd
