// Parked homes: the cpu backend's host tier kept under the homes it feeds.
//
// A lent attach (vmem.cpp) moves a host block's pages under a tensor's home; the
// eviction used to move them back, one mremap each way. mremap of a PMD-mapped
// range flushes the TLB once per 2 MiB huge page it moves, on every core running
// the process (measured: 32 shootdowns per 64 MiB move), so the compute threads
// took one interrupt per 2 MiB streamed, twice per pass. Parking drops the
// device slot and makes the home PROT_NONE in place: one ranged flush for the
// whole tensor. The next load makes it PROT_READ again, which adds permissions to
// entries that were not present and so needs no flush at all. The pages still
// belong to the host tier (the lender stays allocated, holding none); the host
// cache takes them back (unpark onto the lender) or frees them (unpark without
// one) when it wants the block. docs/stable-addresses.md, "Parked pages".
#include <pybind11/pybind11.h>
#include <sys/mman.h>

#include <string>

#include "common.h"
#include "home_faults.h"
#include "vmem.h"

namespace pfd {

namespace {

std::string at(const void *p) {
    char buf[48];
    snprintf(buf, sizeof buf, "the home at 0x%zx", reinterpret_cast<size_t>(p));
    return buf;
}

Error protect_failed(const char *what, const void *p, size_t len, int e) {
    return Error(ErrKind::Native, std::string(what) + ": mprotect of " + std::to_string(len) + " bytes at " + at(p) +
                                      " failed: " + errno_name(e) +
                                      (e == ENOMEM ? " (too many mappings: vm.max_map_count)" : ""));
}

}  // namespace

bool Home::parked() const {
    std::lock_guard<std::mutex> g(res_->mu);
    return parked_;
}

void Home::park(const std::shared_ptr<Block> &b) {
    std::lock_guard<std::mutex> g(res_->mu);
    if (!attached_) throw Error(ErrKind::Value, "park: " + at(ptr_) + " has no block attached");
    if (attached_ != b) throw Error(ErrKind::Value, "park: " + at(ptr_) + " is attached to another block");
    // Compute has finished with the home (it is parked only after its compute fence):
    // no write is in flight that the unwatched PROT_NONE range could lose.
    unwatch_writes(watch_);
    watch_ = -1;
    count_protection_change();
    if (mprotect(ptr_, len_, PROT_NONE) != 0) {
        int e = errno;
        // Still attached as before: watched again (or writable and reported written).
        watch_ = watch_home(ptr_, len_, seen_, false);
        throw protect_failed("park", ptr_, len_, e);
    }
    b->mark_detached();
    attached_.reset();
    parked_ = true;
}

void Home::attach_parked(ArenaImpl &arena, const std::shared_ptr<Block> &b) {
    check_slot(arena, *b, "attach_parked");
    std::lock_guard<std::mutex> g(res_->mu);
    if (!parked_) throw Error(ErrKind::Value, "attach_parked: " + at(ptr_) + " holds no parked pages");
    b->claim_for_attach();   // Closed/ValueError if a release or another attach won the race
    count_protection_change();
    if (mprotect(ptr_, len_, PROT_READ) != 0) {
        int e = errno;
        b->mark_detached();
        throw protect_failed("attach_parked", ptr_, len_, e);
    }
    watch_ = watch_home(ptr_, len_, seen_, true);   // PROT_READ already: only the watch
    attached_ = b;
    parked_ = false;
}

void Home::unpark(const std::shared_ptr<Block> &to) {
    if (to) {
        check_movable(*to, "unpark: the lending");
        if (to->capacity() < len_)
            throw Error(ErrKind::Value, "unpark: a lending block of capacity " + std::to_string(to->capacity()) +
                                            " cannot take the " + std::to_string(len_) + " parked bytes");
    }
    std::lock_guard<std::mutex> g(res_->mu);
    if (!parked_) throw Error(ErrKind::Value, "unpark: " + at(ptr_) + " holds no parked pages");
    if (to) {
        // The pages move with their protection: readable for the lender, which records
        // them read-only (memory.h, "Read-only pages") and makes them writable if written.
        count_protection_change();
        if (mprotect(ptr_, len_, PROT_READ) != 0) throw protect_failed("unpark", ptr_, len_, errno);
        try {
            if (to->readonly_bytes() > len_) to->ensure_writable();   // the read-only part stays a prefix
            BlockClaim hold(*to);
            move_pages(ptr_, to->data(), len_);
        } catch (...) {
            mprotect(ptr_, len_, PROT_NONE);   // still parked: reads fault again
            throw;
        }
        to->set_readonly_bytes(len_);
    }
    reserve_none(ptr_, len_);
    parked_ = false;
}

}  // namespace pfd

// ---------------------------------------------------------------- bindings

namespace py = pybind11;

// Called from module.cpp's PYBIND11_MODULE after bind_vmem.
void bind_home_parking(py::module_ &m) {
    using namespace pfd;
    auto home_cls = py::reinterpret_borrow<py::class_<Home, std::shared_ptr<Home>>>(m.attr("Home"));
    home_cls.def_property_readonly("parked", &Home::parked, "holds parked pages (PROT_NONE, no block attached)");

    py::object arena = m.attr("Arena");
    arena.attr("park") = py::cpp_function(
        [](ArenaImpl &a, std::shared_ptr<Home> home, std::shared_ptr<Block> block) {
            if (!a.owns(*block)) throw Error(ErrKind::Value, "park: the block does not belong to this arena");
            py::gil_scoped_release nogil;
            home->park(block);
        },
        py::name("park"), py::is_method(arena), py::arg("home"), py::arg("block"),
        "detach `block` from the home, leaving the home's pages under it PROT_NONE (one mprotect)");
    arena.attr("attach_parked") = py::cpp_function(
        [](ArenaImpl &a, std::shared_ptr<Block> block, std::shared_ptr<Home> home) {
            py::gil_scoped_release nogil;
            home->attach_parked(a, block);
        },
        py::name("attach_parked"), py::is_method(arena), py::arg("block"), py::arg("home"),
        "make a parked home's pages readable again with `block` attached as their slot (no page move)");
    arena.attr("unpark") = py::cpp_function(
        [](ArenaImpl &, std::shared_ptr<Home> home, std::shared_ptr<Block> pages_to) {
            py::gil_scoped_release nogil;
            home->unpark(pages_to);
        },
        py::name("unpark"), py::is_method(arena), py::arg("home"), py::arg("pages_to") = py::none(),
        "a parked home's pages moved onto pages_to (a movable block), or freed without it");
}
