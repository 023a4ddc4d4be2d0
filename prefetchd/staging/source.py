"""A checkpoint file read with pread, never mapped: a file that shrinks while it is staged
(overwritten in place: `save_checkpoint` to the same path) is an error naming it, where a
mapping's pages past the new end raised SIGBUS and killed the process without a word."""
import mmap
import os
import stat

from .errors import StagingError


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}
_CHUNK = 64 << 10                 # what one structure read fetches around the byte asked for


def _not_regular(path, mode):
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return StagingError(f"{path}: is {kind}, not a checkpoint file" if kind.startswith("a ")
                        else f"{path}: is {kind}")


class SourceFile:
    """The bytes of a checkpoint file as its size was when opened: `len()`, `[i]` (an int),
    `[a:b]` (bytes), `read_into(buffer, offset)`. Structure reads go through a chunk cache (a
    protobuf walk asks byte by byte). StagingError naming the file if it cannot be opened, is
    empty or not a regular file (a FIFO or device is refused before it is opened: opening a
    FIFO waits for a writer forever; O_NONBLOCK covers one swapped in between the two looks),
    or if a read comes back short."""

    def __init__(self, path):
        self.path = path
        try:
            mode = os.stat(path).st_mode
            if not stat.S_ISREG(mode):
                raise _not_regular(path, mode)
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise StagingError(f"{path}: no such file") from None
        except PermissionError:
            raise StagingError(f"{path}: permission denied") from None
        except OSError as e:
            raise StagingError(f"{path}: cannot read: {e.strerror or e}") from None
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise _not_regular(path, st.st_mode)
        if st.st_size == 0:
            self.close()
            raise StagingError(f"{path}: file is empty")
        self.size = st.st_size
        self._chunk_at, self._chunk = -1, b""

    def __len__(self):
        return self.size

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.size)
            return self._pread(start, max(0, stop - start))
        if not 0 <= key < self.size:
            raise IndexError(key)
        at = key - key % _CHUNK
        if at != self._chunk_at:
            self._chunk, self._chunk_at = self._pread(at, min(_CHUNK, self.size - at)), at
        return self._chunk[key - at]

    def _pread(self, offset, length):
        data = os.pread(self.fd, length, offset) if length else b""
        if len(data) != length:
            self._shrank()
        return data

    def read_into(self, buffer, offset):
        """Fill the writable `buffer` with the file's bytes from `offset`."""
        view, done = memoryview(buffer).cast("B"), 0
        try:
            while done < len(view):
                got = os.preadv(self.fd, [view[done:]], offset + done)
                if got == 0:
                    self._shrank()
                done += got
        finally:
            view.release()

    def _shrank(self):
        now = os.fstat(self.fd).st_size
        raise StagingError(f"{self.path}: the file ends at byte {now} now, it had {self.size} bytes when "
                           f"staging began (changed while it was read: stage a file nothing is writing)")

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def buffer(nbytes):
    """A writable buffer for one tensor's bytes: an anonymous mapping, given back to the
    system as soon as it is unreferenced (not kept by the allocator)."""
    return memoryview(mmap.mmap(-1, nbytes)) if nbytes else memoryview(bytearray())


class CheckpointReader:
    """What the .ckpt and .safetensors readers share: a file whose whole structure is
    checked on open (`_read_structure`, StagingError naming the file), then an iterator over
    its tensors (`_stream`), each read into a buffer of its own. Subclasses set `_entries`
    and `_expected_crc` (None: the file carries no checksum)."""

    def __init__(self, path):
        self.path = str(path)
        self._file = SourceFile(self.path)
        try:
            self._read_structure()
        except BaseException:
            self._file.close()
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
        self._file.close()

    def _fail(self, what):
        raise StagingError(f"{self.path}: {what}")
