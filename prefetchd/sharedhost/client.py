"""A daemon's side of the shared host tier: the connection to the owner and its grants.

`SharedHostClient` speaks prefetchd.sharedhost.wire to the owner, one request at a
time; a `Grant` is one leased block, copied out (`read_into`) or mapped over a device
block (`map_into`). The backend's load seam built on them is prefetchd.sharedhost.loads.
"""
import logging
import os
import socket
import threading

from ..socket_dirs import peer_credentials
from . import wire
from .blocks import check_received

log = logging.getLogger("prefetchd.sharedhost")


def _close_fds(fds):
    for fd in fds:
        if fd is not None:
            os.close(fd)


class Refused(Exception):
    """The owner will not share this tensor (code: a wire refusal code, or "corrupt")."""

    def __init__(self, code, reason):
        super().__init__(f"{code}: {reason}")
        self.code = code


def _check_owner_uid(sock, path):
    """PermissionError unless the owner runs as this process's uid: a block is checked only by
    its CRC32C, which the acquire names, so an owner of another uid (its socket put at this
    path by a user who could rename a parent directory) could hand out any bytes."""
    _pid, uid, _gid = peer_credentials(sock)
    if uid != os.getuid():
        raise PermissionError(f"shared host tier {path}: its owner runs as uid {uid}, not {os.getuid()} "
                              f"(this process): refused")


class SharedHostClient:
    """One connection to the owner. Thread-safe (requests are serialised)."""

    def __init__(self, path, name="", timeout=60.0):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
            _check_owner_uid(self.sock, path)
        except OSError:
            self.sock.close()
            raise
        self._lock = threading.Lock()
        self._verified = set()     # (key, version, memfd inode): checksummed once per block
        self.closed = False
        hello = self._call({"op": "hello", "pid": os.getpid(), "name": name[:128]})[0][0]
        self.budget = hello["budget"]
        self.covering = hello.get("covering") is True   # an older owner: never park

    def _call(self, obj, replies=1):
        """Send one request and receive up to `replies` messages: [(reply, fd or None)].
        A refusal naming no item refuses the whole request and is its last reply."""
        with self._lock:
            if self.closed:
                raise ConnectionError(f"shared host tier {self.path}: connection closed")
            got, fd = [], None
            try:
                wire.send(self.sock, obj)
                while len(got) < replies:
                    data, fds, _, _ = socket.recv_fds(self.sock, wire.MAX_MESSAGE, 1)
                    fd = fds[0] if fds else None
                    if not data:
                        raise ConnectionError("the owner closed the connection")
                    got.append((wire.decode(data), fd))
                    fd = None
                    if not got[-1][0].get("ok") and "item" not in got[-1][0]:
                        break
                return got
            except (OSError, wire.WireError) as e:
                # Out of step with the owner (timeout, death, garbage): closing the
                # socket releases every lease this process holds there.
                _close_fds([fd] + [f for _, f in got])
                self._close_locked()
                raise ConnectionError(f"shared host tier {self.path}: {e}") from None

    def acquire(self, key, version, nbytes, crc):
        """A Grant of the sealed block holding these bytes (a lease: `release` it);
        Refused if the owner will not share them or the block fails its checks."""
        result = self.acquire_many([(key, version, nbytes, crc)])[0]
        if isinstance(result, Refused):
            raise result
        return result

    def acquire_many(self, wants):
        """One request for the blocks of `wants`, [(key, version, nbytes, crc)] (at most
        wire.MAX_BATCH): a Grant or a Refused for each, in the order asked.
        ConnectionError (the connection closed: no lease held) if the owner's replies do
        not answer exactly these items."""
        items = [{"key": k, "version": v, "nbytes": n, "crc": c} for k, v, n, c in wants]
        replies = self._call({"op": "acquire", "items": items}, len(items))
        answers = [None] * len(wants)
        for reply, fd in replies:
            index = reply.get("item")
            if (type(index) is not int or not 0 <= index < len(wants) or answers[index] is not None
                    or (reply.get("key"), reply.get("version")) != wants[index][:2]):
                _close_fds(f for _, f in replies)    # e.g. a bad_request naming no item
                self.close()
                raise ConnectionError(f"shared host tier {self.path}: a reply to no item asked: "
                                      f"{reply.get('code')}: {reply.get('reason')}")
            answers[index] = (reply, fd)
        return [self._granted(want, *answer) for want, answer in zip(wants, answers)]

    def _granted(self, want, reply, fd):
        """The Grant a reply makes of `want`, or the Refused it is."""
        key, version, nbytes, crc = want
        if not reply.get("ok"):
            if fd is not None:
                os.close(fd)
            return Refused(reply.get("code", "?"), reply.get("reason", ""))
        try:
            if fd is None:
                raise ValueError("the owner granted a block without its descriptor")
            if (reply.get("nbytes"), reply.get("crc")) != (nbytes, crc):
                raise ValueError(f"the owner granted {reply.get('nbytes')} bytes crc {reply.get('crc')}")
            inode = check_received(fd, nbytes, reply.get("size"))
        except ValueError as e:
            if fd is not None:
                os.close(fd)
            self.release(key, version)
            return Refused("corrupt", str(e))
        return Grant(self, key, version, nbytes, crc, fd, (key, version, inode) in self._verified, inode)

    def release(self, key, version):
        self.release_many([(key, version)])

    def release_many(self, idents):
        """End the leases of [(key, version)] (no reply; batches of wire.MAX_BATCH)."""
        idents = list(idents)
        for at in range(0, len(idents), wire.MAX_BATCH):
            items = [{"key": k, "version": v} for k, v in idents[at:at + wire.MAX_BATCH]]
            try:
                self._call({"op": "release", "items": items}, replies=0)
            except ConnectionError:
                return              # closed: the owner released everything already

    def set_trace(self, names):
        return self._call({"op": "trace", "names": list(names)})[0][0]

    def status(self):
        return self._call({"op": "status"})[0][0]["status"]

    def close(self):
        with self._lock:
            self._close_locked()

    def _close_locked(self):
        if not self.closed:
            self.closed = True
            self.sock.close()


class Grant:
    """One leased block: `read_into` copies it out, `map_into` maps it over a device
    block (either checked against the store's crc the first time this process reads
    this block); `close` releases the lease of a copy, `release` that of a mapping."""

    def __init__(self, client, key, version, nbytes, crc, fd, verified, inode):
        self.client, self.key, self.version, self.nbytes, self.crc = client, key, version, nbytes, crc
        self.fd, self._verified, self._inode = fd, verified, inode

    def map_into(self, block):
        """Map the block's bytes over the device `block` (no copy), checked against the
        store's crc the first time; the descriptor is closed, the lease stays held (the
        caller releases it with `release` once the block is freed). Refused ("corrupt")
        on a mismatch; NativeError if the mapping fails."""
        from .. import _native
        block.map_segment(self.fd, self.nbytes)
        if not self._verified:
            with memoryview(block) as view:
                got = _native.crc32c(view[:self.nbytes])
            if got != self.crc:
                raise Refused("corrupt", f"shared block of {self.key!r} has crc {got:#x}, its "
                                         f"store copy {self.crc:#x}")
            self.client._verified.add((self.key, self.version, self._inode))
            self._verified = True
        os.close(self.fd)
        self.fd = -1

    def release(self):
        """End the lease of a mapped grant (its descriptor is closed already)."""
        self.client.release(self.key, self.version)

    def read_into(self, dst):
        """Copy the block's bytes to the front of the writable buffer dst. A pread, not a
        mapping (docs/shared-host.md, "Copy or map"). Refused
        ("corrupt") if the bytes do not match the crc of this daemon's store copy."""
        from .. import _native
        with memoryview(dst) as view, view.cast("B")[:self.nbytes] as out:
            done = 0
            while done < self.nbytes:
                got = os.preadv(self.fd, [out[done:]], done)
                if got <= 0:
                    raise Refused("corrupt", f"shared block of {self.key!r} ended at {done} bytes")
                done += got
            if not self._verified:
                got = _native.crc32c(out)
                if got != self.crc:
                    raise Refused("corrupt", f"shared block of {self.key!r} has crc {got:#x}, its "
                                             f"store copy {self.crc:#x}")
                self.client._verified.add((self.key, self.version, self._inode))
                self._verified = True

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.client.release(self.key, self.version)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
