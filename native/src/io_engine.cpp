// Helpers shared by the I/O engines.
#include <unistd.h>

#include <cerrno>

#include "common.h"
#include "io_engine.h"

namespace pfd {

ssize_t full_io(bool write, int fd, char *buf, size_t len, uint64_t off) {
    size_t done = 0;
    while (done < len) {
        ssize_t r = write ? pwrite(fd, buf + done, len - done, off_t(off + done))
                          : pread(fd, buf + done, len - done, off_t(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;  // the errno says more than the partial count
        }
        if (r == 0) break;  // EOF on read; a zero-byte write makes no progress either
        done += size_t(r);
    }
    return ssize_t(done);
}

void apply_fault(const Transfer &t, size_t i, ssize_t &res, size_t len) {
    if (i != 0) return;
    if (t.fault.kind == FaultKind::Error) res = -t.fault.err;
    else if (t.fault.kind == FaultKind::Short && res > 0) res = ssize_t(len / 2);
}

}  // namespace pfd
