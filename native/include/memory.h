// Device-tier Arena, host-tier HostPool and the Block both hand out.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace pfd {

// Transparent huge pages: blocks of at least this many bytes start on a
// boundary of it in an arena or pool created with huge_pages, so copies into
// them take fewer TLB misses and the mremap page moves of vmem.h move whole
// page-middle-directory entries instead of 512 page-table entries each.
constexpr size_t kHugePage = size_t(2) << 20;

// Ask for transparent huge pages on [p, p+len) (a no-op where the kernel has
// them off or lacks them: they are a speed-up, never needed).
void advise_huge_pages(void *p, size_t len);

// One anonymous mapping. Shared by every Block cut from it, so a view on a
// block never dangles even after the Arena or HostPool is closed.
struct Mapping {
    void *raw = nullptr;   // what mmap returned
    size_t raw_len = 0;
    char *base = nullptr;  // aligned start inside raw
    size_t len = 0;
    // Private anonymous memory: its pages can be moved to another address with
    // mremap (block_moves.cpp). Memory shared with other processes (a memfd
    // segment) must not be: a move would leave its source still mapping them.
    bool movable = true;
    // [base, base + huge_len) is advised MADV_HUGEPAGE (an arena or pool with
    // huge_pages): a range put back after a segment was mapped there is advised
    // again (segment_maps.cpp), so it merges with its neighbours.
    size_t huge_len = 0;
    Mapping(size_t len, size_t alignment);  // throws OutOfSpace/NativeError
    ~Mapping();
    Mapping(const Mapping &) = delete;
    Mapping &operator=(const Mapping &) = delete;
};

// Something a Block returns its bytes to.
struct BlockOwner {
    virtual ~BlockOwner() = default;
    virtual void give_back(int64_t offset, size_t capacity, size_t nbytes) = 0;
};

class Block {
  public:
    Block(std::shared_ptr<Mapping> m, std::shared_ptr<BlockOwner> owner, char *ptr, size_t nbytes,
          size_t capacity, int64_t offset)
        : mapping_(std::move(m)), owner_(std::move(owner)), ptr_(ptr), nbytes_(nbytes), capacity_(capacity),
          offset_(offset) {}
    ~Block();
    char *data() const { return ptr_; }
    uintptr_t address() const { return reinterpret_cast<uintptr_t>(ptr_); }
    size_t nbytes() const { return nbytes_; }
    size_t capacity() const { return capacity_; }
    int64_t offset() const { return offset_; }
    bool released() const { return state_.load() == kReleased; }
    bool attached() const { return state_.load() == kAttached; }
    void release();           // Closed("block already released") the second time;
                              // NativeError while attached to a Home (its pages live there)
    void check_live() const;  // Closed if released
    const BlockOwner *owner() const { return owner_.get(); }
    bool movable() const { return mapping_ && mapping_->movable; }
    // Live -> attached (its pages are mapped at a Home, vmem.h) and back. One
    // atomic state, so a release racing an attach cannot both win.
    void claim_for_attach();  // Closed if released, ValueError if already attached
    void mark_detached() { state_.store(kLive); }
    // Read-only pages. Pages moved in from a read-only home keep their protection
    // (mremap moves it with them), so [data, data + readonly_bytes()) may be
    // mapped PROT_READ while the rest is writable: a block lent back and forth
    // between the host tier and a home never changes protection (each change
    // costs a TLB shootdown of every core computing). Whoever writes the block
    // makes it writable first (module.cpp's buffer access does); a released
    // block gives its range back writable.
    size_t readonly_bytes() const { return readonly_.load(); }
    void set_readonly_bytes(size_t n) { readonly_.store(n); }
    void ensure_writable();   // NativeError if mprotect fails
    // After its pages moved away: writable again. No page is mapped there, so no
    // TLB entry can exist and the change needs no shootdown (not counted below);
    // best effort: on failure the range stays marked read-only.
    void writable_while_empty();
    // Segments shared with other processes (segment_maps.cpp). map_segment maps the
    // first len bytes of a sealed memfd over the block's range, private and read-only
    // (no copy: the pages stay the other processes' too; a write gets a private copy).
    // Until the block is released its range may map the file (mremap carries the
    // mapping to a home and back; the range a move leaves behind still maps it), so
    // release puts fresh anonymous memory back first. Moves mark their destination.
    void map_segment(int fd, size_t len);   // Value/Native errors; never on an attached block
    bool maps_segment() const { return maps_segment_.load(); }
    void mark_maps_segment() { maps_segment_.store(true); }

  private:
    bool unmap_segment() noexcept;   // fresh anonymous memory over the range if it maps one; false if mmap failed
    std::shared_ptr<Mapping> mapping_;
    std::shared_ptr<BlockOwner> owner_;
    char *ptr_;
    size_t nbytes_, capacity_;
    int64_t offset_;
    static constexpr int kLive = 0, kAttached = 1, kReleased = 2;
    std::atomic<int> state_{kLive};
    std::atomic<size_t> readonly_{0};
    std::atomic<bool> maps_segment_{false};
};

// Protection changes (mprotect) made by blocks and homes, for tests and the
// per-pass report: each is a TLB shootdown of every core running this process.
uint64_t protection_changes();
void count_protection_change();

// Whether this kernel moves private file mappings with MREMAP_DONTUNMAP (Linux >=
// 5.13), which attaching a block that maps a segment needs. Probed once.
bool segment_maps_supported();

// Best-fit allocator over one lazily faulted mapping; the free list is ordered by offset so
// neighbours coalesce on free and fragmentation stays visible (largest_free).
// With huge_pages, blocks of kHugePage or more start on a kHugePage boundary.
class ArenaImpl : public BlockOwner, public std::enable_shared_from_this<ArenaImpl> {
  public:
    ArenaImpl(size_t capacity, size_t alignment, bool huge_pages = false);
    std::shared_ptr<Block> alloc(size_t nbytes, int64_t prefer = -1);
    void give_back(int64_t offset, size_t capacity, size_t nbytes) override;
    void close();
    size_t capacity() const { return capacity_; }
    size_t alignment() const { return alignment_; }
    bool huge_pages() const { return huge_; }
    size_t used() const;
    size_t peak_used() const;
    size_t num_blocks() const;
    size_t largest_free() const;
    bool closed() const;
    bool owns(const Block &b) const { return b.owner() == this; }

  private:
    std::shared_ptr<Block> take(std::map<size_t, size_t>::iterator it, size_t start, size_t nbytes, size_t need);
    size_t capacity_, alignment_;
    bool huge_;
    std::shared_ptr<Mapping> mapping_;
    mutable std::mutex mu_;
    std::map<size_t, size_t> free_;  // offset -> length
    size_t used_ = 0, peak_ = 0, blocks_ = 0;
    bool closed_ = false;
};

// Exact-budget pool of individually mapped, aligned staging buffers. With
// huge_pages, buffers of kHugePage or more are huge-page aligned and advised.
class HostPoolImpl : public BlockOwner, public std::enable_shared_from_this<HostPoolImpl> {
  public:
    HostPoolImpl(size_t budget, size_t alignment, bool lock_memory, bool huge_pages = false);
    std::shared_ptr<Block> alloc(size_t nbytes);
    void give_back(int64_t offset, size_t capacity, size_t nbytes) override;
    void close();
    size_t budget() const { return budget_; }
    size_t used() const;
    size_t peak_used() const;
    bool locked() const;
    bool closed() const;
    bool huge_pages() const { return huge_; }

  private:
    size_t budget_, alignment_;
    bool lock_, huge_;
    mutable std::mutex mu_;
    size_t used_ = 0, peak_ = 0;
    bool all_locked_;
    bool closed_ = false;
};

std::shared_ptr<Block> aligned_buffer(size_t nbytes, size_t alignment);
void check_alignment(size_t alignment);  // power of two, else ValueError

}  // namespace pfd
