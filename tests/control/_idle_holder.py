"""A process holding connections to a daemon's control server, for
tests/control/test_idle_connections.py.

argv: endpoint, clients, slow (1: each client then sends a prefetch the daemon is slow
to answer). Holds `clients` clients, each through the guard (a ping answered), and a
subscription (the first client's), prints "held <monotonic time before the first ping>", then on a line
of stdin prints how often each of its sockets was disconnected: "sub N" and "clients N",
and, with slow, "codes [...]": what each slow request ended in.
"""
import sys
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from prefetchd.control import Client


def disconnects(monitor):
    n = 0
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        n += event["event"] == zmq.EVENT_DISCONNECTED
    return n


def main():
    endpoint, n, slow = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    first = time.monotonic()
    clients = [Client(endpoint, timeout=30) for _ in range(n)]
    sub = clients[0].subscribe()
    sub.sync()
    for c in clients:
        c.ping()
    watched = [c._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) for c in clients]
    sub_watch = sub._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    codes = [None] * n

    def slow_call(i):
        try:
            clients[i].prefetch(["layer.7.weight"], timeout=25)
            codes[i] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the test
            codes[i] = type(e).__name__

    threads = [threading.Thread(target=slow_call, args=(i,)) for i in range(n)] if slow else []
    for t in threads:
        t.start()
    print("held", first, flush=True)
    sys.stdin.readline()
    for t in threads:
        t.join(30)
    print("sub", disconnects(sub_watch), flush=True)
    print("clients", sum(disconnects(m) for m in watched), flush=True)
    if slow:
        print("codes", codes, flush=True)


if __name__ == "__main__":
    main()
