"""Fixtures of tests/control."""
import socket
import time

import pytest

from prefetchd.control.handshakes import tcp_counts


@pytest.fixture
def pairs():
    """connect(send=b"") -> the server side's descriptor of a new loopback TCP connection
    whose client has sent `send` (received by the kernel when this returns)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    made = []

    def connect(send=b""):
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        made.extend((client, server))
        if send:
            client.sendall(send)
            deadline = time.monotonic() + 5
            while tcp_counts(server.fileno())[1] < len(send) and time.monotonic() < deadline:
                time.sleep(0.001)
        return server.fileno()
    yield connect
    for s in made:
        s.close()
    listener.close()
