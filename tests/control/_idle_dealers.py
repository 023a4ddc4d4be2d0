"""A process holding `n` idle connections to a server: raw DEALER sockets that connect and
never send (libzmq connects each again by itself when the server shuts it down), for
tests/control/test_idle_connections.py. argv: endpoint, n. Prints "held", exits on a line
of stdin."""
import sys

import zmq


def main():
    endpoint, n = sys.argv[1], int(sys.argv[2])
    ctx = zmq.Context()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(endpoint)
        socks.append(s)
    print("held", flush=True)
    sys.stdin.readline()
    for s in socks:
        s.close()
    ctx.term()


if __name__ == "__main__":
    main()
