// Stable virtual addresses for managed tensors: a VirtualRange reserves
// address space with no memory behind it; a Home is a page-aligned slice of it
// where one tensor lives for life. Residency moves physical pages between an
// arena Block and a Home with mremap (page tables only, no copy), so the
// framework tensor that views the Home never has to be rebound.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "memory.h"

namespace pfd {

size_t page_size();

// Move the pages of [src, src+len) onto [dst, dst+len) (page-aligned, len a
// multiple of the page size) with mremap(MREMAP_FIXED | MREMAP_DONTUNMAP):
// page tables only, no byte copied. dst's old pages are dropped; src stays
// mapped with no pages behind it (reads see zeros). NativeError if the kernel
// refuses; a failure after a partial move puts the moved part back.
void move_pages(char *src, char *dst, size_t len);

// ValueError/Closed unless `b` can give or take pages by move_pages: live, not
// attached, private anonymous memory, page-aligned. `what` names the operation and
// the block for the message (e.g. "move_pages: the source").
void check_movable(const Block &b, const std::string &what);

// A block held (no release, no attach) while its pages move: Closed/ValueError
// if a release or an attach won the race.
struct BlockClaim {
    Block &b;
    explicit BlockClaim(Block &block) : b(block) { b.claim_for_attach(); }
    ~BlockClaim() { b.mark_detached(); }
    BlockClaim(const BlockClaim &) = delete;
    BlockClaim &operator=(const BlockClaim &) = delete;
};

// PROT_NONE | MAP_NORESERVE reservation. Shared by the VirtualRange and every
// Home cut from it, so the address space stays reserved while any Home (or a
// buffer view of one) lives.
struct Reservation {
    void *raw = nullptr;   // what mmap returned (over-reserved for alignment)
    size_t raw_len = 0;
    char *base = nullptr;  // aligned start inside raw
    size_t len = 0;        // page-rounded usable length
    std::mutex mu;         // guards `slices` and every Home's attachment state
    std::map<size_t, size_t> slices;  // offset -> length of live Homes (no overlaps)
    int fault_slot = -1;   // home_faults.h: a read of a detached Home here says so before dying
    Reservation(size_t nbytes, size_t alignment);
    ~Reservation();
    Reservation(const Reservation &) = delete;
    Reservation &operator=(const Reservation &) = delete;
};

class Home;

// Shared by vmem.cpp and home_parking.cpp. reserve_none: back to an
// address-space-only reservation (reads fault, no memory held). watch_home: read-only
// with writes watched (home_faults.h), the slot or -1 if left writable and unwatched;
// `readonly`: the range is PROT_READ already (no protection change, no TLB shootdown).
void reserve_none(char *p, size_t len);
int watch_home(char *p, size_t len, uint64_t &seen, bool readonly);

class VirtualRange {
  public:
    VirtualRange(size_t nbytes, size_t alignment);
    uintptr_t address() const;
    size_t nbytes() const;
    bool closed() const;
    // A Home at `offset` (page-aligned) covering nbytes rounded up to a page;
    // ValueError when misaligned, past the end or overlapping a live Home.
    std::shared_ptr<Home> slice(size_t offset, size_t nbytes);
    void close();  // idempotent; live Homes keep the reservation mapped

  private:
    std::shared_ptr<Reservation> res_;
    uintptr_t address_;
    size_t nbytes_;
};

class Home {
  public:
    Home(std::shared_ptr<Reservation> r, size_t offset, size_t nbytes, size_t len)
        : res_(std::move(r)), ptr_(res_->base + offset), offset_(offset), nbytes_(nbytes), len_(len) {}
    ~Home();
    char *data() const { return ptr_; }
    uintptr_t address() const { return reinterpret_cast<uintptr_t>(ptr_); }
    size_t offset() const { return offset_; }
    size_t nbytes() const { return nbytes_; }
    size_t capacity() const { return len_; }
    bool attached() const;
    std::shared_ptr<Block> block() const;  // the attached block, or null

    // Move `block`'s pages here; the block's own range gets fresh untouched pages.
    // With `lender` (a host block of private anonymous memory), the pages come from
    // the lender instead, and `block` is attached holding none of them: one move per
    // load from the host tier instead of two (docs/stable-addresses.md, "Zero-copy tiers").
    void attach(ArenaImpl &arena, const std::shared_ptr<Block> &block,
                const std::shared_ptr<Block> &lender = nullptr);
    // Move the pages back onto `block` (the attached one), or with `to` onto that block
    // instead (the lender taking its pages back); the home faults again.
    void detach(const std::shared_ptr<Block> &block, const std::shared_ptr<Block> &to = nullptr);

    // An attached home is read-only with its writes watched (home_faults.h).
    // True if it was written since it was attached or since the last call that
    // returned true (or if it could not be watched); the next write is caught
    // again. False while detached.
    bool take_written();
    bool write_watched() const;  // attached and watched (false: every take_written is true)

    // Parking (home_parking.cpp; docs/stable-addresses.md, "Parked pages"): a lent
    // home's pages stay under it while its tensor is not resident, PROT_NONE, so the
    // next load from the host tier is one permission change instead of a page move.
    bool parked() const;
    // Detach `block` (the attached one: the device budget's slot) and make the home
    // PROT_NONE holding its pages. Reads fault as on a detached home.
    void park(const std::shared_ptr<Block> &block);
    // The parked pages readable again, `block` attached as their slot (no page moves).
    void attach_parked(ArenaImpl &arena, const std::shared_ptr<Block> &block);
    // The parked pages moved onto `to` (the lender taking them back), or freed without
    // `to`; the home is re-reserved PROT_NONE|MAP_NORESERVE either way.
    void unpark(const std::shared_ptr<Block> &to);

  private:
    std::shared_ptr<Reservation> res_;
    char *ptr_;
    size_t offset_, nbytes_, len_;
    std::shared_ptr<Block> attached_;  // guarded by res_->mu; keeps the block allocated
    int watch_ = -1;                   // write-watch slot while attached, or -1 (unwatched)
    bool parked_ = false;              // guarded by res_->mu; holds pages, PROT_NONE, no block
    void check_slot(ArenaImpl &arena, Block &b, const char *what) const;
    uint64_t seen_ = 0;                // its write count when take_written last looked
};

}  // namespace pfd
