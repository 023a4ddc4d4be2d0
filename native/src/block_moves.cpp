// move_pages(dst, src): a block's bytes change blocks without being copied.
//
// On the CPU backend the host tier and the device tier are the same DRAM, so
// pages move instead of bytes: a load from the host tier moves the host block's
// pages straight under the tensor's home (Arena.attach with a lender, vmem.cpp)
// and the eviction moves them back. move_pages itself moves pages between two
// blocks (no home). Each move is one mremap (page tables only; for 2 MiB-aligned
// ranges one entry per huge page), see docs/stable-addresses.md "Zero-copy tiers".
#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>

#include "common.h"
#include "memory.h"
#include "vmem.h"

namespace pfd {

void check_movable(const Block &b, const std::string &what) {
    if (b.released()) throw Error(ErrKind::Closed, what + " block is released");
    if (b.attached())
        throw Error(ErrKind::Value, what + " block is attached to a home (its pages are mapped there); detach it first");
    if (!b.movable())
        throw Error(ErrKind::Value, what + " block is not private anonymous memory (its pages cannot be moved); copy it");
    if (!is_aligned(b.data(), page_size())) throw Error(ErrKind::Value, what + " block is not page-aligned");
}

// Returns the bytes moved (src's pages, nbytes rounded up to the page size).
size_t move_block_pages(const std::shared_ptr<Block> &dst, const std::shared_ptr<Block> &src) {
    if (dst.get() == src.get()) throw Error(ErrKind::Value, "move_pages: source and destination are the same block");
    check_movable(*dst, "move_pages: the destination");
    check_movable(*src, "move_pages: the source");
    size_t len = round_up(src->nbytes(), page_size());
    if (dst->nbytes() < src->nbytes() || dst->capacity() < len || src->capacity() < len)
        throw Error(ErrKind::Value, "move_pages: a destination of " + std::to_string(dst->nbytes()) +
                                        " bytes (capacity " + std::to_string(dst->capacity()) +
                                        ") cannot take the pages of a source of " + std::to_string(src->nbytes()) +
                                        " bytes (capacity " + std::to_string(src->capacity()) + ", " +
                                        std::to_string(len) + " to move)");
    uintptr_t d = dst->address(), s = src->address();
    if (len && d < s + len && s < d + len) throw Error(ErrKind::Value, "move_pages: the blocks overlap");
    if (len == 0) return 0;
    // dst's first len bytes take src's protection with its pages (memory.h, "Read-only
    // pages"); a read-only part of dst beyond them is made writable first, so the
    // read-only part stays one prefix.
    if (dst->readonly_bytes() > len) dst->ensure_writable();
    BlockClaim hold_src(*src);   // ValueError/Closed if a release or attach won the race
    BlockClaim hold_dst(*dst);
    move_pages(src->data(), dst->data(), len);
    if (src->maps_segment()) dst->mark_maps_segment();   // the file mapping moved with the pages
    dst->set_readonly_bytes(std::min(src->readonly_bytes(), len));
    src->writable_while_empty();   // its range holds no pages now
    return len;
}

}  // namespace pfd

namespace py = pybind11;

// Called from module.cpp's PYBIND11_MODULE after Block is bound.
void bind_block_moves(py::module_ &m) {
    using namespace pfd;
    m.def(
        "move_pages",
        [](std::shared_ptr<Block> dst, std::shared_ptr<Block> src) {
            py::gil_scoped_release nogil;
            return move_block_pages(dst, src);
        },
        py::arg("dst"), py::arg("src"),
        "Move src's pages under dst (mremap, no copy); src then reads zeros. Returns the bytes moved.");
    auto block_cls = py::reinterpret_borrow<py::class_<Block, std::shared_ptr<Block>>>(m.attr("Block"));
    block_cls.def_property_readonly("movable", &Block::movable,
                                    "private anonymous memory: move_pages can move its pages");
}
