// Block.map_segment: a device block backed by a segment other processes share.
//
// The shared host tier (prefetchd/sharedhost) keeps each tensor once per machine in
// a sealed memfd. On the CPU backend a daemon loading from it need not copy: the
// segment's pages are mapped over the device block's range (MAP_PRIVATE, read-only,
// populated), and the block then moves to the tensor's home and back like any other
// (mremap carries the file mapping; vmem.cpp). A write by compute faults (the home is
// watched, home_faults.h), the home is made writable and the write gets a private
// copy of that page: the segment never changes. docs/shared-host.md, "Copy or map".
//
// A range a move leaves behind (MREMAP_DONTUNMAP) still maps the segment, with no
// pages; and a range that maps it holds the segment alive. So a block marked
// maps_segment puts fresh anonymous memory back over its whole range before its
// bytes return to the arena (Block::release), and moves mark their destination.
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "common.h"
#include "memory.h"
#include "vmem.h"

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

namespace pfd {

namespace {

// Anonymous read-write memory over [p, p+len), re-advised for huge pages where its
// mapping was, so the range merges back into its neighbours' kernel mapping.
bool put_anonymous(const Mapping &m, char *p, size_t len) {
    void *r = mmap(p, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (r == MAP_FAILED) return false;
#ifdef MADV_HUGEPAGE
    char *huge_end = m.base + m.huge_len, *end = p + len;
    if (m.huge_len && p < huge_end) madvise(p, size_t(std::min(end, huge_end) - p), MADV_HUGEPAGE);
#else
    (void)m;
#endif
    return true;
}

}  // namespace

void Block::map_segment(int fd, size_t len) {
    size_t page = page_size();
    len = round_up(len, page);
    if (!movable())
        throw Error(ErrKind::Value, "map_segment: the block is not private anonymous memory of an arena or pool");
    if (!is_aligned(ptr_, page)) throw Error(ErrKind::Value, "map_segment: the block is not page-aligned");
    if (len == 0 || len > capacity_)
        throw Error(ErrKind::Value, "map_segment: " + std::to_string(len) + " bytes do not fit the block's capacity of " +
                                        std::to_string(capacity_));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        throw Error(ErrKind::Value, "map_segment: fstat of descriptor " + std::to_string(fd) + ": " + errno_name(e));
    }
    if (!S_ISREG(st.st_mode) || size_t(st.st_size) < len)
        throw Error(ErrKind::Value, "map_segment: the segment holds " + std::to_string(st.st_size) + " bytes, " +
                                        std::to_string(len) + " asked");
    claim_for_attach();   // Closed if released, ValueError if attached: nobody else maps this range now
    struct Unclaim {
        Block *b;
        ~Unclaim() { b->mark_detached(); }
    } unclaim{this};
    if (readonly_.load() > len) ensure_writable();   // the read-only part stays one prefix
    maps_segment_.store(true);   // before the mmap: a failure below may leave the range mapping part of it
    void *r = mmap(ptr_, len, PROT_READ, MAP_PRIVATE | MAP_FIXED | MAP_POPULATE, fd, 0);
    if (r == MAP_FAILED) {
        int e = errno;
        if (put_anonymous(*mapping_, ptr_, capacity_)) maps_segment_.store(false), readonly_.store(0);
        throw Error(ErrKind::Native, "mapping a shared segment of " + std::to_string(len) + " bytes over a block failed: " +
                                         errno_name(e));
    }
    readonly_.store(len);   // mapped PROT_READ: a writer makes it writable (and private) first
}

bool Block::unmap_segment() noexcept {
    if (!maps_segment_.load()) return true;
    if (capacity_ && !put_anonymous(*mapping_, ptr_, capacity_)) return false;
    readonly_.store(0);
    maps_segment_.store(false);
    return true;
}

bool segment_maps_supported() {
    static const bool supported = [] {
        size_t page = page_size();
        int fd = memfd_create("prefetchd-probe", MFD_CLOEXEC);
        if (fd < 0) return false;
        bool ok = false;
        void *space = mmap(nullptr, 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (ftruncate(fd, off_t(page)) == 0 && space != MAP_FAILED) {
            char *a = static_cast<char *>(space), *b = a + page;
            if (mmap(a, page, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0) != MAP_FAILED)
                ok = mremap(a, page, page, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, b) != MAP_FAILED;
        }
        if (space != MAP_FAILED) munmap(space, 2 * page);
        close(fd);
        return ok;
    }();
    return supported;
}

}  // namespace pfd

namespace py = pybind11;

// Called from module.cpp's PYBIND11_MODULE after Block is bound.
void bind_segment_maps(py::module_ &m) {
    using namespace pfd;
    auto block_cls = py::reinterpret_borrow<py::class_<Block, std::shared_ptr<Block>>>(m.attr("Block"));
    block_cls
        .def(
            "map_segment",
            [](Block &b, int fd, size_t nbytes) {
                py::gil_scoped_release nogil;
                b.map_segment(fd, nbytes);
            },
            py::arg("fd"), py::arg("nbytes"),
            "Map the first nbytes (page-rounded) of the file `fd` (a sealed memfd) over the block, "
            "private and read-only: no copy; a write gets a private copy of its page. The block "
            "keeps mapping it until released (release puts anonymous memory back).")
        .def_property_readonly("maps_segment", &Block::maps_segment,
                               "its range maps a shared segment (map_segment, or pages moved in from one)");
    m.def("segment_maps_supported", &segment_maps_supported,
          "whether this kernel can move private file mappings (MREMAP_DONTUNMAP, Linux >= 5.13): "
          "Block.map_segment's blocks can then be attached to homes");
}
