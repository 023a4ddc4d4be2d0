"""libzmq's descriptors, looked at from Python without taking them over.

The connection guard (prefetchd.control.connections, handshakes, syn_gate) reads and
shuts down sockets that libzmq owns, knowing only their descriptor numbers. A Python
socket object made on such a number must be detached, never closed: closing it would
close libzmq's descriptor under it.
"""
import contextlib
import os
import socket

import zmq


@contextlib.contextmanager
def borrowed(fd):
    """`fd` as a socket object for the block (detached after it), or None if `fd` is no
    socket now."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()             # the descriptor stays libzmq's


def socket_id(sock, *, listening):
    """The inode of `sock` if it is a listener (`listening`) or not one, as asked; None
    otherwise. An inode names one socket for as long as it is open, so a descriptor
    number reused by another socket since has another."""
    try:
        if bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)) != listening:
            return None
        return os.fstat(sock.fileno()).st_ino
    except OSError:
        return None


def source_fd(frame):
    """The descriptor of the connection `frame` (a message's first) came on; None once that
    connection is closed (libzmq then refuses the query with EINVAL): nobody to answer."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
