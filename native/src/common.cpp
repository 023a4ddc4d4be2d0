// Error/status mapping shared by the store, streams and bindings.
#include "common.h"

#include <cstring>

namespace pfd {

int status_of(const Error &e) {
    if (e.status != 0) return e.status;
    switch (e.kind) {
        case ErrKind::Checksum: return STATUS_CHECKSUM;
        case ErrKind::NotFound: return STATUS_NOT_FOUND;
        case ErrKind::Closed: return STATUS_CANCELLED;
        case ErrKind::IOFailure: return EIO;
        default: return EINVAL;
    }
}

ErrKind kind_of_status(int status) {
    if (status > 0) return ErrKind::IOFailure;
    switch (status) {
        case STATUS_CHECKSUM: return ErrKind::Checksum;
        case STATUS_SHORT_READ: return ErrKind::IOFailure;
        case STATUS_NOT_FOUND: return ErrKind::NotFound;
        case STATUS_CANCELLED: return ErrKind::Closed;
        default: return ErrKind::Native;
    }
}

std::string errno_name(int err) {
    switch (err) {
#define E(x) case x: return #x;
        E(EPERM) E(ENOENT) E(EIO) E(ENXIO) E(EBADF) E(EAGAIN) E(ENOMEM) E(EACCES) E(EFAULT)
        E(EBUSY) E(EEXIST) E(ENODEV) E(ENOTDIR) E(EISDIR) E(EINVAL) E(ENFILE) E(EMFILE)
        E(EFBIG) E(ENOSPC) E(ESPIPE) E(EROFS) E(EPIPE) E(ERANGE) E(ENAMETOOLONG) E(ENOSYS)
        E(EDQUOT) E(EOVERFLOW) E(EINTR) E(ETIMEDOUT) E(ECANCELED) E(EOPNOTSUPP) E(ESTALE)
        E(ELOOP) E(EXDEV) E(ENOTEMPTY) E(ENOLCK) E(ETXTBSY) E(EMLINK) E(ENOTCONN) E(EHOSTDOWN)
#undef E
        default: return "errno " + std::to_string(err) + " (" + std::strerror(err) + ")";
    }
}

}  // namespace pfd
