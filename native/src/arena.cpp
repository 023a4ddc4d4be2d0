// Arena: the device tier on CPU builds. One mapping reserved up front (faulted
// lazily), carved best-fit; Blocks share the mapping so views stay valid after close().
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "memory.h"

namespace pfd {

void check_alignment(size_t alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0)
        throw Error(ErrKind::Value, "alignment must be a power of two, got " + std::to_string(alignment));
}

Mapping::Mapping(size_t n, size_t alignment) {
    size_t page = size_t(sysconf(_SC_PAGESIZE));
    size_t al = std::max(alignment, page);
    len = round_up(std::max<size_t>(n, 1), page);
    // Over-reserve when the alignment exceeds a page, then use the aligned part.
    raw_len = len + (al > page ? al : 0);
    raw = mmap(nullptr, raw_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
        raw = nullptr;
        int e = errno;
        throw Error(ErrKind::OutOfSpace, "mmap of " + std::to_string(raw_len) + " bytes failed: " + errno_name(e));
    }
    base = reinterpret_cast<char *>(round_up(reinterpret_cast<uintptr_t>(raw), al));
}

Mapping::~Mapping() {
    if (raw) munmap(raw, raw_len);
}

namespace {
std::atomic<uint64_t> g_protection_changes{0};
}  // namespace

uint64_t protection_changes() { return g_protection_changes.load(); }
void count_protection_change() { g_protection_changes.fetch_add(1); }

void Block::ensure_writable() {
    size_t n = readonly_.load();
    if (n == 0) return;
    count_protection_change();
    if (mprotect(ptr_, n, PROT_READ | PROT_WRITE) != 0) {
        int e = errno;
        throw Error(ErrKind::Native, "making the block at offset " + std::to_string(offset_) + " writable failed: " +
                                         errno_name(e) + " (too many mappings? see vm.max_map_count)");
    }
    readonly_.store(0);
}

void Block::writable_while_empty() {
    size_t n = readonly_.load();
    if (n && mprotect(ptr_, n, PROT_READ | PROT_WRITE) == 0) readonly_.store(0);
}

Block::~Block() {
    // A Block dropped without release() still returns its bytes. (An attached
    // block is owned by its Home, which marks it detached before dropping it.)
    int s = kLive;
    if (state_.compare_exchange_strong(s, kReleased) && owner_) {
        try {
            if (!unmap_segment()) return;   // keep a range still mapping a segment out of the free list
            ensure_writable();   // the next block cut from this range is written
        } catch (...) {
            return;              // keep the range out of the free list rather than hand it out read-only
        }
        owner_->give_back(offset_, capacity_, nbytes_);
    }
}

void Block::release() {
    int s = kLive;
    if (state_.load() == kLive) {   // throws before anything changed
        if (!unmap_segment())
            throw Error(ErrKind::Native, "putting anonymous memory back under the block at offset " +
                                             std::to_string(offset_) + " failed (too many mappings? see vm.max_map_count)");
        if (readonly_.load()) ensure_writable();
    }
    if (state_.compare_exchange_strong(s, kReleased)) {
        if (owner_) owner_->give_back(offset_, capacity_, nbytes_);
        return;
    }
    if (s == kAttached)
        throw Error(ErrKind::Native, "block is attached to a home (its pages are mapped there); detach it first");
    throw Error(ErrKind::Closed, "block already released");
}

void Block::check_live() const {
    if (released()) throw Error(ErrKind::Closed, "block already released");
}

void Block::claim_for_attach() {
    int s = kLive;
    if (state_.compare_exchange_strong(s, kAttached)) return;
    if (s == kReleased) throw Error(ErrKind::Closed, "block already released");
    throw Error(ErrKind::Value, "attach: the block is already attached to another home");
}

void advise_huge_pages(void *p, size_t len) {
#ifdef MADV_HUGEPAGE
    if (len >= kHugePage) madvise(p, len, MADV_HUGEPAGE);  // EINVAL without THP support: fine
#else
    (void)p;
    (void)len;
#endif
}

ArenaImpl::ArenaImpl(size_t capacity, size_t alignment, bool huge_pages)
    : capacity_(capacity), alignment_(alignment), huge_(huge_pages) {
    check_alignment(alignment);
    capacity_ = capacity / alignment * alignment;  // only whole aligned units are usable
    mapping_ = std::make_shared<Mapping>(capacity_, huge_ ? std::max(alignment, kHugePage) : alignment);
    if (huge_) advise_huge_pages(mapping_->base, mapping_->len);
    if (huge_) mapping_->huge_len = mapping_->len;
    // Nothing is faulted in here: a page costs memory from its first write on
    // and is reused (never zeroed again) after that, so a budget larger than
    // what is actually loaded costs address space only. Whether the budget can
    // ever be backed is checked by the backend (prefetchd/limits.py, check_budgets).
    if (capacity_ > 0) free_[0] = capacity_;
}

// Carve [start, start+need) out of the free range `it` (which holds it); the
// pieces before and after stay free. Called with mu_ held.
std::shared_ptr<Block> ArenaImpl::take(std::map<size_t, size_t>::iterator it, size_t start, size_t nbytes,
                                       size_t need) {
    size_t off = it->first, len = it->second;
    free_.erase(it);
    if (start > off) free_[off] = start - off;
    if (off + len > start + need) free_[start + need] = off + len - start - need;
    used_ += need;
    peak_ = std::max(peak_, used_);
    blocks_++;
    return std::make_shared<Block>(mapping_, shared_from_this(), mapping_->base + start, nbytes, need,
                                   int64_t(start));
}

std::shared_ptr<Block> ArenaImpl::alloc(size_t nbytes, int64_t prefer) {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) throw Error(ErrKind::Closed, "arena is closed");
    size_t need = round_up(nbytes, alignment_);
    if (need == 0) {
        blocks_++;
        return std::make_shared<Block>(mapping_, shared_from_this(), mapping_->base, 0, 0, 0);
    }
    // A preferred offset (where the tensor lived last time) wins when it is free:
    // the framework tensor still views that address, so it need not be rebound.
    if (prefer >= 0 && size_t(prefer) % alignment_ == 0) {
        size_t want = size_t(prefer);
        auto it = free_.upper_bound(want);
        if (it != free_.begin()) {
            --it;
            if (it->first <= want && it->first + it->second >= want + need) return take(it, want, nbytes, need);
        }
    }
    // Best fit: the smallest free range that holds the request, so small tensors
    // fill small holes and large runs stay whole for large tensors. A large block
    // starts on a huge-page boundary where one fits, else anywhere (huge pages
    // are a speed-up, never a reason to refuse).
    std::vector<size_t> starts = {alignment_};
    if (huge_ && need >= kHugePage) starts.insert(starts.begin(), kHugePage);
    for (size_t start_align : starts) {
        auto best = free_.end();
        size_t best_start = 0;
        for (auto it = free_.begin(); it != free_.end(); ++it) {
            size_t start = round_up(it->first, start_align), end = it->first + it->second;
            if (start > end || end - start < need) continue;
            if (best == free_.end() || it->second < best->second) best = it, best_start = start;
            if (it->second == need) break;
        }
        if (best != free_.end()) return take(best, best_start, nbytes, need);
    }
    size_t largest = 0;
    for (auto &f : free_) largest = std::max(largest, f.second);
    throw Error(ErrKind::OutOfSpace, "arena cannot fit " + std::to_string(nbytes) + " bytes (" +
                                         std::to_string(need) + " aligned): used " + std::to_string(used_) + " of " +
                                         std::to_string(capacity_) + ", largest free " + std::to_string(largest));
}

void ArenaImpl::give_back(int64_t offset, size_t cap, size_t) {
    std::lock_guard<std::mutex> g(mu_);
    blocks_--;
    if (cap == 0) return;
    used_ -= cap;
    if (closed_) return;  // free list is gone; nothing to coalesce into
    size_t off = size_t(offset), len = cap;
    // The pages stay (reused without a fault or zeroing when this range is taken
    // again) but the kernel may reclaim them under memory pressure: an arena with
    // more address space than budget (the CPU backend's, against fragmentation)
    // then costs no more memory than the bytes in use.
    madvise(mapping_->base + off, len, MADV_FREE);
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + len == next->first) {  // merge with right neighbour
        len += next->second;
        next = free_.erase(next);
    }
    if (next != free_.begin()) {  // merge with left neighbour
        auto prev = std::prev(next);
        if (prev->first + prev->second == off) {
            prev->second += len;
            return;
        }
    }
    free_[off] = len;
}

void ArenaImpl::close() {
    std::lock_guard<std::mutex> g(mu_);
    closed_ = true;
    free_.clear();
    mapping_.reset();  // outstanding blocks still hold it
}

size_t ArenaImpl::used() const { std::lock_guard<std::mutex> g(mu_); return used_; }
size_t ArenaImpl::peak_used() const { std::lock_guard<std::mutex> g(mu_); return peak_; }
size_t ArenaImpl::num_blocks() const { std::lock_guard<std::mutex> g(mu_); return blocks_; }
bool ArenaImpl::closed() const { std::lock_guard<std::mutex> g(mu_); return closed_; }
size_t ArenaImpl::largest_free() const {
    std::lock_guard<std::mutex> g(mu_);
    size_t largest = 0;
    for (auto &f : free_) largest = std::max(largest, f.second);
    return largest;
}

std::shared_ptr<Block> aligned_buffer(size_t nbytes, size_t alignment) {
    check_alignment(alignment);
    auto m = std::make_shared<Mapping>(nbytes, alignment);
    char *p = m->base;
    return std::make_shared<Block>(std::move(m), nullptr, p, nbytes, round_up(nbytes, alignment), -1);
}

}  // namespace pfd
