// VirtualRange / Home: stable tensor addresses; Arena.attach/detach move a
// block's physical pages to and from a Home with mremap. See vmem.h.
//
// Both moves use MREMAP_DONTUNMAP: the kernel moves the page tables and leaves
// the source mapping in place with no pages behind it, in one syscall under
// the mm lock. So no window exists in which the source range is unmapped and
// another thread's mmap(NULL) could land in it (which a plain move followed by
// a MAP_FIXED refill would allow, and the refill would then clobber).
#include "vmem.h"

#include <pybind11/pybind11.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "common.h"
#include "home_faults.h"

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

namespace pfd {

size_t page_size() {
    static const size_t p = size_t(sysconf(_SC_PAGESIZE));
    return p;
}

namespace {

std::string hex(const void *p) {
    char buf[32];
    snprintf(buf, sizeof buf, "0x%zx", reinterpret_cast<size_t>(p));
    return buf;
}

}  // namespace

// Move [src, src+len) onto [dst, dst+len) keeping src mapped (empty). A range
// that spans several kernel VMAs (mremap refuses those with EFAULT) is moved
// in halves; a failure after a partial move puts the moved part back.
void move_pages(char *src, char *dst, size_t len) {
    void *r = mremap(src, len, len, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, dst);
    if (r != MAP_FAILED) return;
    int e = errno;
    size_t page = page_size();
    if (e == EFAULT && len > page) {
        size_t half = len / 2 / page * page;
        move_pages(src, dst, half);
        try {
            move_pages(src + half, dst + half, len - half);
        } catch (...) {
            mremap(dst, half, half, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, src);
            throw;
        }
        return;
    }
    throw Error(ErrKind::Native, "mremap of " + std::to_string(len) + " bytes from " + hex(src) + " to " + hex(dst) +
                                     " failed: " + errno_name(e) +
                                     (e == EINVAL ? " (MREMAP_DONTUNMAP needs Linux >= 5.7)" : ""));
}

// Back to an address-space-only reservation: reads fault, no memory is held.
void reserve_none(char *p, size_t len) {
    void *r = mmap(p, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (r == MAP_FAILED) {
        int e = errno;
        throw Error(ErrKind::Native, "re-reserving " + std::to_string(len) + " bytes at " + hex(p) +
                                         " failed: " + errno_name(e));
    }
}

// Reads only, writes watched (home_faults.h); -1 where the home stays writable
// and unwatched (no mprotect, or the watch table is full).
// `readonly`: the pages arrived read-only (memory.h, "Read-only pages"), so no
// protection change (and no TLB shootdown) is needed.
int watch_home(char *p, size_t len, uint64_t &seen, bool readonly) {
    if (!readonly) {
        count_protection_change();
        if (mprotect(p, len, PROT_READ) != 0) return -1;
    }
    int slot = watch_writes(reinterpret_cast<uintptr_t>(p), len);
    if (slot < 0) {
        count_protection_change();
        mprotect(p, len, PROT_READ | PROT_WRITE);
        return -1;
    }
    seen = watched_writes(slot);
    return slot;
}

Reservation::Reservation(size_t nbytes, size_t alignment) {
    check_alignment(alignment);
    size_t page = page_size();
    size_t al = std::max(alignment, page);
    if (nbytes == 0) throw Error(ErrKind::Value, "VirtualRange: nbytes must be > 0");
    len = round_up(nbytes, page);
    raw_len = len + (al > page ? al : 0);
    raw = mmap(nullptr, raw_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
        raw = nullptr;
        int e = errno;
        throw Error(ErrKind::OutOfSpace,
                    "reserving " + std::to_string(raw_len) + " bytes of address space failed: " + errno_name(e));
    }
    base = reinterpret_cast<char *>(round_up(reinterpret_cast<uintptr_t>(raw), al));
    fault_slot = register_home_range(reinterpret_cast<uintptr_t>(base), len);
}

Reservation::~Reservation() {
    unregister_home_range(fault_slot);
    if (raw) munmap(raw, raw_len);
}

VirtualRange::VirtualRange(size_t nbytes, size_t alignment)
    : res_(std::make_shared<Reservation>(nbytes, alignment)),
      address_(reinterpret_cast<uintptr_t>(res_->base)),
      nbytes_(res_->len) {}

uintptr_t VirtualRange::address() const { return address_; }
size_t VirtualRange::nbytes() const { return nbytes_; }
bool VirtualRange::closed() const { return !res_; }

std::shared_ptr<Home> VirtualRange::slice(size_t offset, size_t nbytes) {
    if (!res_) throw Error(ErrKind::Closed, "virtual range is closed");
    size_t page = page_size();
    if (offset % page)
        throw Error(ErrKind::Value, "home offset " + std::to_string(offset) + " is not a multiple of the page size " +
                                        std::to_string(page));
    size_t len = round_up(std::max<size_t>(nbytes, 1), page);
    if (offset > nbytes_ || len > nbytes_ - offset)
        throw Error(ErrKind::Value, "home [" + std::to_string(offset) + ", +" + std::to_string(len) +
                                        ") does not fit in the virtual range of " + std::to_string(nbytes_) + " bytes");
    std::lock_guard<std::mutex> g(res_->mu);
    auto next = res_->slices.lower_bound(offset);
    if (next != res_->slices.end() && next->first < offset + len)
        throw Error(ErrKind::Value, "home [" + std::to_string(offset) + ", +" + std::to_string(len) +
                                        ") overlaps the live home at offset " + std::to_string(next->first));
    if (next != res_->slices.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second > offset)
            throw Error(ErrKind::Value, "home [" + std::to_string(offset) + ", +" + std::to_string(len) +
                                            ") overlaps the live home at offset " + std::to_string(prev->first));
    }
    res_->slices[offset] = len;
    return std::make_shared<Home>(res_, offset, nbytes, len);
}

void VirtualRange::close() { res_.reset(); }

Home::~Home() {
    std::lock_guard<std::mutex> g(res_->mu);
    if (attached_) {
        // Dropping a resident home frees its pages; the block (whose own
        // range holds fresh untouched pages) goes back to the arena.
        unwatch_writes(watch_);
        try {
            reserve_none(ptr_, len_);
        } catch (...) {
        }
        attached_->mark_detached();
        attached_.reset();
    } else if (parked_) {
        try {
            reserve_none(ptr_, len_);   // the parked pages are freed with the home
        } catch (...) {
        }
    }
    res_->slices.erase(offset_);
}

bool Home::attached() const {
    std::lock_guard<std::mutex> g(res_->mu);
    return bool(attached_);
}

std::shared_ptr<Block> Home::block() const {
    std::lock_guard<std::mutex> g(res_->mu);
    return attached_;
}

// What every attach asks of the block it attaches (a page source or only a slot).
void Home::check_slot(ArenaImpl &arena, Block &b, const char *what) const {
    std::string op = what;
    if (arena.closed()) throw Error(ErrKind::Closed, "arena is closed");
    if (!arena.owns(b)) throw Error(ErrKind::Value, op + ": the block does not belong to this arena");
    b.check_live();  // early, clear error; claim_for_attach is the race-free check
    size_t page = page_size();
    if (!is_aligned(b.data(), page))
        throw Error(ErrKind::Value, op + ": block address " + hex(b.data()) + " is not page-aligned (arena alignment " +
                                        std::to_string(arena.alignment()) + " < page size " + std::to_string(page) + ")");
    if (b.nbytes() < nbytes_ || b.capacity() < len_)
        throw Error(ErrKind::Value, op + ": block of " + std::to_string(b.nbytes()) + " bytes (capacity " +
                                        std::to_string(b.capacity()) + ") cannot back a home of " +
                                        std::to_string(nbytes_) + " bytes (" + std::to_string(len_) + " mapped)");
}

void Home::attach(ArenaImpl &arena, const std::shared_ptr<Block> &b, const std::shared_ptr<Block> &lender) {
    check_slot(arena, *b, "attach");
    if (lender) {
        if (lender.get() == b.get()) throw Error(ErrKind::Value, "attach: the lender is the block itself");
        check_movable(*lender, "attach: the lending");
        if (lender->nbytes() < nbytes_ || lender->capacity() < len_)
            throw Error(ErrKind::Value, "attach: a lending block of " + std::to_string(lender->nbytes()) +
                                            " bytes (capacity " + std::to_string(lender->capacity()) +
                                            ") cannot fill a home of " + std::to_string(nbytes_) + " bytes");
    }
    Block &source = lender ? *lender : *b;
    std::lock_guard<std::mutex> g(res_->mu);
    if (attached_) throw Error(ErrKind::Value, "attach: the home at " + hex(ptr_) + " already has a block attached");
    if (parked_)
        throw Error(ErrKind::Value, "attach: the home at " + hex(ptr_) +
                                        " holds parked pages (attach_parked or unpark them first)");
    b->claim_for_attach();  // from here on release() refuses, another attach too
    bool arrives_readonly = source.readonly_bytes() >= len_;
    try {
        if (lender) {
            BlockClaim hold(*lender);   // Closed/ValueError if a release or a move won the race
            move_pages(lender->data(), ptr_, len_);
        } else {
            move_pages(b->data(), ptr_, len_);
        }
    } catch (...) {
        b->mark_detached();
        throw;
    }
    attached_ = b;
    watch_ = watch_home(ptr_, len_, seen_, arrives_readonly);
    source.writable_while_empty();   // its range holds no pages now
}

void Home::detach(const std::shared_ptr<Block> &b, const std::shared_ptr<Block> &to) {
    if (to) {
        if (to.get() == b.get()) throw Error(ErrKind::Value, "detach: the lender is the attached block itself");
        check_movable(*to, "detach: the lending");
        if (to->capacity() < len_)
            throw Error(ErrKind::Value, "detach: a lending block of capacity " + std::to_string(to->capacity()) +
                                            " cannot take the " + std::to_string(len_) + " mapped bytes of the home");
    }
    Block &dest = to ? *to : *b;
    std::lock_guard<std::mutex> g(res_->mu);
    if (!attached_) throw Error(ErrKind::Value, "detach: the home at " + hex(ptr_) + " has no block attached");
    if (attached_ != b)
        throw Error(ErrKind::Value, "detach: the home at " + hex(ptr_) + " holds the pages of the block at " +
                                        hex(attached_->data()) + ", not of the block at " + hex(b->data()));
    // The pages leave with their protection: read-only unless a write since the
    // watch was last armed made the home writable (home_faults.h). The block then
    // records it, and whoever writes it next makes it writable (memory.h, "Read-only
    // pages"): a clean page move back and forth changes no protection. Compute has
    // finished with the home by now: it is detached only after its compute fence.
    bool readonly = watch_ >= 0 && watched_writes(watch_) == seen_;
    if (dest.readonly_bytes() > len_) dest.ensure_writable();   // the read-only part stays a prefix
    if (to) {
        BlockClaim hold(*to);
        move_pages(ptr_, to->data(), len_);
    } else {
        move_pages(ptr_, b->data(), len_);
    }
    unwatch_writes(watch_);
    watch_ = -1;
    dest.set_readonly_bytes(readonly ? len_ : 0);
    reserve_none(ptr_, len_);
    b->mark_detached();
    attached_.reset();
}

bool Home::take_written() {
    std::lock_guard<std::mutex> g(res_->mu);
    if (!attached_) return false;
    if (watch_ < 0) return true;
    uint64_t before = watched_writes(watch_);
    if (before == seen_) return false;   // no write faulted since: still read-only
    // Read-only again, then look once more: a write that faulted in between may
    // have made it writable after our mprotect, so protect again until none did.
    for (;;) {
        while (before & 1) {             // a write is being let through: let it finish
            sched_yield();
            before = watched_writes(watch_);
        }
        count_protection_change();
        if (mprotect(ptr_, len_, PROT_READ) != 0) {   // cannot re-arm: unwatched, always "written"
            unwatch_writes(watch_);
            watch_ = -1;
            mprotect(ptr_, len_, PROT_READ | PROT_WRITE);
            return true;
        }
        uint64_t after = watched_writes(watch_);
        if (after == before) break;
        before = after;
    }
    seen_ = before;
    return true;
}

bool Home::write_watched() const {
    std::lock_guard<std::mutex> g(res_->mu);
    return attached_ && watch_ >= 0;
}

}  // namespace pfd

// ---------------------------------------------------------------- bindings

namespace py = pybind11;

// Called from module.cpp's PYBIND11_MODULE after Arena and Block are bound.
void bind_vmem(py::module_ &m) {
    using namespace pfd;
    // The huge-page size the arena, the host pool and shared segments align to (Python's one copy).
    m.attr("HUGE_PAGE") = kHugePage;
    py::class_<VirtualRange, std::shared_ptr<VirtualRange>>(m, "VirtualRange")
        .def(py::init<size_t, size_t>(), py::arg("nbytes"), py::arg("align") = kHugePage)
        .def_property_readonly("address", &VirtualRange::address)
        .def_property_readonly("nbytes", &VirtualRange::nbytes)
        .def_property_readonly("closed", &VirtualRange::closed)
        .def("slice", &VirtualRange::slice, py::arg("offset"), py::arg("nbytes"),
             "a Home at `offset` (page-aligned) of nbytes (mapped length rounded up to a page)")
        .def("close", &VirtualRange::close)
        .def("__repr__", [](const VirtualRange &r) {
            return "<VirtualRange nbytes=" + std::to_string(r.nbytes()) + (r.closed() ? " closed>" : ">");
        });

    py::class_<Home, std::shared_ptr<Home>>(m, "Home", py::buffer_protocol())
        .def_buffer([](Home &h) {
            return py::buffer_info(h.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {py::ssize_t(h.nbytes())}, {py::ssize_t(1)}, false);
        })
        .def_property_readonly("address", &Home::address)
        .def_property_readonly("offset", &Home::offset)
        .def_property_readonly("nbytes", &Home::nbytes)
        .def_property_readonly("capacity", &Home::capacity)
        .def_property_readonly("attached", &Home::attached)
        .def_property_readonly("block", &Home::block)
        .def("take_written", &Home::take_written,
             "True if the attached home was written since it was attached or since the last True; "
             "re-arms the watch (attached homes are read-only, writes fault once and are counted)")
        .def_property_readonly("write_watched", &Home::write_watched,
                               "attached with its writes watched (else take_written is always True)")
        .def("__len__", &Home::nbytes)
        .def("__repr__", [](const Home &h) {
            return "<Home nbytes=" + std::to_string(h.nbytes()) + " offset=" + std::to_string(h.offset()) +
                   (h.attached() ? " attached>" : " detached>");
        });

    auto block_cls = py::reinterpret_borrow<py::class_<Block, std::shared_ptr<Block>>>(m.attr("Block"));
    block_cls.def_property_readonly("attached", &Block::attached, "its pages are mapped at a Home");

    py::object arena = m.attr("Arena");
    arena.attr("attach") = py::cpp_function(
        [](ArenaImpl &a, std::shared_ptr<Block> block, std::shared_ptr<Home> home, std::shared_ptr<Block> pages_from) {
            py::gil_scoped_release nogil;
            home->attach(a, block, pages_from);
        },
        py::name("attach"), py::is_method(arena), py::sibling(py::getattr(arena, "attach", py::none())),
        py::arg("block"), py::arg("home"), py::arg("pages_from") = py::none(),
        "move the block's pages onto the home (mremap); the block's range gets fresh untouched pages. "
        "With pages_from (a movable host block), that block's pages move onto the home instead and "
        "`block` is attached holding none: the lender reads zeros until detach(..., pages_to=lender)");
    arena.attr("detach") = py::cpp_function(
        [](ArenaImpl &a, std::shared_ptr<Home> home, std::shared_ptr<Block> block, std::shared_ptr<Block> pages_to) {
            if (!a.owns(*block)) throw Error(ErrKind::Value, "detach: the block does not belong to this arena");
            py::gil_scoped_release nogil;
            home->detach(block, pages_to);
        },
        py::name("detach"), py::is_method(arena), py::sibling(py::getattr(arena, "detach", py::none())),
        py::arg("home"), py::arg("block"), py::arg("pages_to") = py::none(),
        "move the home's pages back onto the block, or onto pages_to (a movable block: the lender "
        "taking its pages back); the home faults (PROT_NONE) again");
}
