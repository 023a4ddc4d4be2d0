"""Flood scripts shared by the connection-flood tests (tests/control, tests/serve): run each
with `python -c SCRIPT args...`; it prints a line starting "flooded" once its connections are open."""
import textwrap

# argv: host port n hold_seconds. n tcp connections that never send a byte, each reopened at
# once when the server drops it, for hold_seconds.
RAW_KEEPER = textwrap.dedent("""
    import selectors, socket, sys, time
    host, port, n, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    sel = selectors.DefaultSelector()
    def open_one():
        s = socket.socket()
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            return False
        sel.register(s, selectors.EVENT_READ)
        return True
    opened = sum(open_one() for _ in range(n))
    print("flooded", opened, flush=True)
    end = time.monotonic() + hold
    while time.monotonic() < end:            # reopen every connection the server drops, at once
        for key, _ in sel.select(0.05):
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_one()
""")
