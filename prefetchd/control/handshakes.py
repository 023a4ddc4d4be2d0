"""TCP connections still in their ZMTP handshake, kept apart from those through it.

On a CURVE endpoint a peer without an authorized key never gets through the
handshake, but until libzmq gives up on it (`handshake_ivl`) it holds a descriptor;
counted against its address's budget from the accept on, ~1,100 of them crowded the
authorized clients from the same address out for good (each dropped one reconnects).
So the connection guard (prefetchd.control.connections) holds a new tcp connection
here first: at most `budget` at once, and a new one beyond that pushes the *oldest*
out (shut down). A peer that holds a connection silent loses it to the next
connect; an authorized client, whose handshake takes milliseconds, is through
before a flood can push it out, and only then counts against its peer's budget.

Who goes first is read off the kernel (TCP_INFO): a peer that has sent nothing
(tcpi_bytes_received), then one that sent less than a greeting for GREETING_GRACE
or has had no answer for ANSWER_GRACE (the server sent no more than its greeting,
tcpi_bytes_acked), then one stalled mid-handshake. A ZMTP peer sends its greeting
as soon as its connect completes, so the kernel has it at once, while the server's
answer lags whenever libzmq's I/O thread is busy accepting and closing a flood:
judged by the answer alone, a client accepted in the same burst as the flood looked
as silent as the flood and was pushed out with it; judged by its first bytes alone,
a flood that sends a few bytes of greeting and stalls kept every slot and locked new
clients out.

libzmq's monitor says that a handshake succeeded but not for which descriptor, so
this reads it off the connection: the bytes the server sent and the peer
acknowledged (TCP_INFO's tcpi_bytes_acked). The server sends READY only once the
peer's greeting arrived (NULL) or its key passed ZAP (CURVE); before that it has sent
at most its greeting (64 bytes) and a WELCOME (170), and a peer refused by ZAP gets
an ERROR and is closed. A READY is at least 27 bytes (NULL) or 51 (CURVE, boxed):
the thresholds below. Measured on loopback: 107 (NULL) and 301 (CURVE) bytes once
through, 10 for a peer that never spoke.
"""
import collections
import errno
import socket
import struct
import time

from .borrowed import borrowed

GREETING = 64
THROUGH_NULL = GREETING + 27                 # a NULL READY sent: the peer spoke ZMTP
THROUGH_CURVE = GREETING + 170 + 51          # a CURVE READY sent: the peer's key passed ZAP
STALLED = 1.0                                # seconds mid-handshake after which a connection may be pushed out
GREETING_GRACE = 0.1                         # seconds a peer may take to send its whole greeting
ANSWER_GRACE = 0.25                          # seconds a connection that spoke may wait for the server's answer
# struct tcp_info (Linux >= 4.1): tcpi_bytes_acked at 120, tcpi_bytes_received after it
_COUNTS = struct.Struct("=QQ")
_COUNTS_AT = 120


GONE = -1
UNKNOWN = (None, None)


def tcp_counts(fd):
    """(bytes the server sent on `fd` that the peer acknowledged, bytes received from the
    peer); UNKNOWN where TCP_INFO has no such fields (an older kernel, or not a TCP
    socket); GONE if `fd` is no socket now."""
    with borrowed(fd) as sock:
        if sock is None:
            return GONE
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError as e:
            return GONE if e.errno in (errno.EBADF, errno.ENOTSOCK) else UNKNOWN
    if len(info) < _COUNTS_AT + _COUNTS.size:
        return UNKNOWN
    return _COUNTS.unpack_from(info, _COUNTS_AT)


def bytes_acked(fd):
    """tcp_counts' first: None where unknown, GONE if `fd` is no socket now."""
    counts = tcp_counts(fd)
    return counts if counts is GONE else counts[0]


SILENT, PARTIAL, SPOKE, ANSWERED = 0, 1, 2, 3    # how far a handshake got (only ever grows)


def progress(fd):
    """SILENT: the peer on `fd` has sent nothing (or `fd` is gone); PARTIAL: less than a
    greeting; ANSWERED: the server sent more than its greeting (the peer's greeting
    came, and for CURVE its HELLO), or TCP_INFO says nothing (as `through` counts it);
    else SPOKE."""
    counts = tcp_counts(fd)
    if counts is GONE:
        return SILENT
    acked, received = counts
    if acked is None or acked > GREETING:
        return ANSWERED
    return SPOKE if received >= GREETING else PARTIAL if received else SILENT


class Handshakes:
    """Handshaking connections, oldest first: fd -> [peer key, bytes that mean "through",
    its progress when last looked at, when it came]."""

    def __init__(self, budget, clock=time.monotonic):
        self.budget = budget
        self._clock = clock
        self._fds = collections.OrderedDict()

    def __len__(self):
        return len(self._fds)

    def __contains__(self, fd):
        return fd in self._fds

    def add(self, fd, key, through):
        """Hold `fd`; returns the fds to shut down to stay within the budget: the oldest
        connection whose peer has sent nothing; else the oldest with less than a greeting
        after GREETING_GRACE seconds or no answer after ANSWER_GRACE (a peer that stalls
        after a few bytes: a client sends its whole greeting at once and the server answers
        it at once, unless its I/O thread is buried in a flood, which the graces cover);
        else the oldest stalled mid-handshake for STALLED seconds;
        else `fd` itself (every one held is young or mid-handshake: they finish, or are
        refused by ZAP and closed, within milliseconds)."""
        out = []
        if len(self._fds) >= self.budget:
            victim = self._victim()
            if victim is None:
                return [fd]
            del self._fds[victim]
            out.append(victim)
        self._fds[fd] = [key, through, SILENT, self._clock()]
        return out

    def _victim(self):
        now, unanswered, stalled = self._clock(), None, None
        for fd, held in self._fds.items():                    # oldest first
            if held[2] != ANSWERED:
                # Looked at again now: the peer may have spoken since, or been answered
                # (a connection added in this very batch has not been looked at yet).
                held[2] = max(held[2], progress(fd))
                if held[2] == SILENT:
                    return fd
            age = now - held[3]
            if unanswered is None and (held[2] == PARTIAL and age >= GREETING_GRACE
                                       or held[2] == SPOKE and age >= ANSWER_GRACE):
                unanswered = fd
            if stalled is None and age >= STALLED:
                stalled = fd
        return unanswered if unanswered is not None else stalled

    def pop_victim(self):
        """The connection `add` would push out first, else the oldest, no longer held; None
        when none is held. For a client through its handshake that needs a descriptor."""
        victim = self._victim()
        if victim is None and self._fds:
            victim = next(iter(self._fds))
        if victim is not None:
            del self._fds[victim]
        return victim

    def discard(self, fd):
        self._fds.pop(fd, None)

    def through(self):
        """[(fd, peer key)] of the connections whose handshake ended since the last call
        (no longer held here); one whose TCP_INFO says nothing counts as through, one
        that is no socket any more is forgotten."""
        done = []
        for fd, held in list(self._fds.items()):
            key, threshold = held[0], held[1]
            sent = bytes_acked(fd)
            if sent == GONE:
                del self._fds[fd]
            elif sent is None or sent >= threshold:
                del self._fds[fd]
                done.append((fd, key))
        return done
