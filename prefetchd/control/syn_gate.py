"""Stop a TCP listener from taking new connections without unbinding it.

The connection guard (prefetchd.control.connections) stops listening while the
descriptors run short. Unbinding a libzmq endpoint does that, but it also discards
the pipes of every connection the endpoint accepted (zmq_unbind(3): "the incoming
message queue associated with the endpoint will be discarded"): those connections
stay open and their requests are read and silently dropped, so every client
connected during a pause waits out its timeout (measured: a DEALER's request sent
after the unbind, and after binding again, never reached the ROUTER).

A classic BPF program that accepts nothing, attached to the listening socket
(SO_ATTACH_FILTER), makes the kernel drop the SYNs and handshake ACKs that reach
it, so no new connection completes, while the connections already accepted are
sockets of their own and go on. A client's SYN dropped meanwhile is sent again
(after 1 s, then 3 s, ... by the kernel), and gets through once the gate opens
(SO_DETACH_FILTER). Linux only; `close` says False where it cannot attach, and the
caller unbinds instead (ipc endpoints have a gate of their own: prefetchd.control.path_gate).
"""
import ctypes
import ctypes.util
import socket

from .borrowed import borrowed, socket_id

SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27
BPF_RET_K = 0x06            # BPF_RET | BPF_K: return the constant (bytes to keep; 0 = drop)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


_DROP_ALL = (_SockFilter * 1)(_SockFilter(BPF_RET_K, 0, 0, 0))
_PROGRAM = _SockFprog(1, ctypes.cast(_DROP_ALL, ctypes.POINTER(_SockFilter)))
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def listener_id(fd):
    """The inode of `fd` if it is a listening TCP socket now, else None."""
    with borrowed(fd) as sock:
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6) \
                or sock.type != socket.SOCK_STREAM:
            return None
        return socket_id(sock, listening=True)


def close(fd, ident):
    """Drop new connections to the listener `fd` (if it still is the one `ident`
    names). True if the gate is closed."""
    if ident is None or listener_id(fd) != ident:
        return False
    rc = _libc.setsockopt(fd, socket.SOL_SOCKET, SO_ATTACH_FILTER, ctypes.byref(_PROGRAM),
                          ctypes.sizeof(_PROGRAM))
    return rc == 0


def open_(fd, ident):
    """Let new connections to the listener `fd` through again. True if it was gated."""
    if ident is None or listener_id(fd) != ident:
        return False
    unused = ctypes.c_int(0)      # the kernel wants an int-sized value it does not read
    return _libc.setsockopt(fd, socket.SOL_SOCKET, SO_DETACH_FILTER, ctypes.byref(unused),
                            ctypes.sizeof(unused)) == 0
