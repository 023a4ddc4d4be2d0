"""Read-only mappings of checkpoint files, released page by page as tensors are staged."""
import mmap
import os
import stat

from .errors import StagingError


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}


def _not_regular(path, mode):
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return StagingError(f"{path}: is {kind}, not a checkpoint file" if kind.startswith("a ")
                        else f"{path}: is {kind}")


def open_mapped(path):
    """A read-only mmap of `path`; StagingError naming the file if it cannot be opened, is empty
    or is not a regular file. A FIFO or device is refused before it is opened (opening a FIFO
    waits for a writer forever); O_NONBLOCK covers one swapped in between the two looks."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(path, st.st_mode)
            if st.st_size == 0:
                raise StagingError(f"{path}: file is empty")
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise StagingError(f"{path}: no such file") from None
    except PermissionError:
        raise StagingError(f"{path}: permission denied") from None
    except OSError as e:
        raise StagingError(f"{path}: cannot read: {e.strerror or e}") from None


def forget(mm, start, length):
    """Drop the pages of a range already staged, so RSS holds one tensor at a time."""
    page = mmap.PAGESIZE
    lo = start - start % page
    hi = min(len(mm), start + length)
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def close_quietly(mm):
    try:
        mm.close()
    except BufferError:
        pass   # a consumer still holds a slice; the mapping goes with its last view


class MappedCheckpoint:
    """What the .ckpt and .safetensors readers share: a mapped file whose whole
    structure is checked on open (`_read_structure`, StagingError naming the file),
    then an iterator over its tensors (`_stream`). Subclasses set `_entries` and
    `_expected_crc` (None: the file carries no checksum)."""

    def __init__(self, path):
        self.path = str(path)
        self._mm = open_mapped(self.path)
        try:
            self._read_structure()
        except BaseException:
            close_quietly(self._mm)
            raise
        self._iter = self._stream()

    @property
    def tensors(self):
        return len(self._entries)

    @property
    def has_checksum(self):
        """True if the file carries a checksum (verified as iteration ends)."""
        return self._expected_crc is not None

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._iter)

    def close(self):
        self._iter.close()
        close_quietly(self._mm)

    def _fail(self, what):
        raise StagingError(f"{self.path}: {what}")
