"""Bounds on the connections a server's sockets accept, so peers cannot use up the
process's file descriptors.

Every connection libzmq accepts is a descriptor in the daemon's process, and at
the RLIMIT_NOFILE limit libzmq 4.3's ipc listener does not fail the accept: it
aborts the process (`Too many open files (src/ipc_listener.cpp)`, SIGABRT), with
every dirty tensor not yet written back. libzmq has no option that bounds
accepted connections, so the guard watches each socket's monitor (ACCEPTED and
DISCONNECTED carry the connection's descriptor) and shuts down (shutdown(2);
libzmq then closes it and frees the descriptor) every accepted connection beyond

  - `max_connections` held at once by the server's sockets,
  - `max_per_peer` from one peer (a process, by SO_PEERCRED, on ipc; an address
    on tcp), so one process opening clients in a loop cannot crowd others out,
  - the admit line: limit - 2 * `fd_reserve` descriptors in use (one reserve for
    the store's reads and write-backs, one for what libzmq accepts before the
    guard runs).

When the descriptors in use come within `fd_reserve` of the soft limit anyway (a
burst accepted faster than the guard drops it, or descriptors the rest of the
process took: looked at on every accept and at least once a second), the guard
stops the listeners until the descriptors in use are back at the admit line, by a
gate that leaves the connected peers served on (prefetchd.control.gates): a tcp
listener drops new connections' SYNs, an ipc one's socket file is moved aside. Only
an endpoint whose gate is gone is unbound, which discards its connected peers'
pipes: their requests go unanswered and their clients time out. A burst of more than
`fd_reserve` connections accepted before the guard runs could still reach the
limit, which is why a server also raises
the soft RLIMIT_NOFILE to the hard one (`raise_fd_limit`). At the default reserve
of 64 and a limit of 1024: admitted up to 896 descriptors, listeners stopped above 960.
Peers that connect and never finish a ZMTP/CURVE handshake are dropped by
libzmq itself after `handshake_ivl` (socket options in `configure`); before that, a
tcp connection counts against no peer's budget: it waits among at most
`handshake_budget` others still in their handshake, the oldest pushed out by a new
one (prefetchd.control.handshakes), so peers without an authorized CURVE key cannot
crowd out the authorized clients from the same address. A connection through its
handshake goes before the ones still in theirs: they give their descriptors up for it.

A server that reports its requests (`idle_after`, `saw`, `busy`) also keeps idle
connections from crowding out new ones: at a budget, a new connection waits for its
first request and then takes the place of the connection of that budget longest
without one, idle at least `idle_after` seconds (prefetchd.control.idle_room). The
evicted client's libzmq connects again by itself; a request sent in the very instant
of the shutdown is lost with the connection and its client times out, as on any
dropped connection. Connections to a socket watched with `idle=False` (a PUB
socket's subscribers, which never send a request) are never taken for idle.
"""
import collections
import itertools
import logging
import resource
import socket
import struct
import time

import zmq

from ..socket_dirs import peer_credentials
from .borrowed import borrowed, socket_id
from .descriptors import open_descriptors, raise_fd_limit
from .gates import Gates
from .handshakes import THROUGH_CURVE, THROUGH_NULL, Handshakes
from .idle_room import IdleRoom

log = logging.getLogger("prefetchd.control.connections")

DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_MAX_PER_PEER = 64
DEFAULT_FD_RESERVE = 64
DEFAULT_HANDSHAKE_BUDGET = 64    # tcp connections held in their handshake at once
IDLE_EVICT_AFTER = 5.0           # seconds without a request before a connection gives way at a budget
HANDSHAKE_IVL_MS = 5000          # a peer has this long to finish its handshake (CURVE included)
HEARTBEAT_IVL_MS = 10000         # ZMTP pings find peers that vanished without a FIN
HEARTBEAT_TIMEOUT_MS = 30000
RECHECK_INTERVAL = 2.0           # seconds between looks for connections closed without a DISCONNECTED
FD_CHECK_INTERVAL = 0.5          # seconds between looks at the descriptors in use, accepts or not

_MONITORS = itertools.count()


# Set on a NULL-mechanism server socket: with a ZAP domain libzmq refuses ZMTP 1.0 and 2.0
# peers, and bytes whose first is not 0xFF (an HTTP request, junk) read as a ZMTP 1.0
# greeting: such a peer was through the handshake at once and held its connection for good,
# its junk delivered as messages (an outside probe). With no ZAP handler in the context
# (ZAP_ENFORCE_DOMAIN off, libzmq's default) ZMTP 3 peers are let in as before.
NULL_ZAP_DOMAIN = b"prefetchd-null"


def configure(sock, fd_reserve=DEFAULT_FD_RESERVE):
    """Socket options that drop peers which hold a connection without speaking ZMTP, and
    a listen backlog of half the descriptor reserve: a paused listener still accepts what
    it had queued (libzmq's default of 100 is more than the reserve; an outside probe
    aborted the daemon that way in 13 of 13 bursts at a 256 limit)."""
    sock.setsockopt(zmq.BACKLOG, max(4, min(100, fd_reserve // 2)))
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def _peer_of(fd):
    """(peer key, socket) of an accepted descriptor; None if it is no longer a socket."""
    with borrowed(fd) as sock:
        if sock is None:
            return None
        try:
            if sock.family == socket.AF_UNIX:
                pid, uid, _ = peer_credentials(sock)
                return ("pid", pid, uid)
            return ("addr", sock.getpeername()[0])
        except OSError:
            return None


def _connection_id(fd):
    """The inode of the connected socket `fd` is now, None if it is no such socket.

    The guard learns descriptor numbers from monitor events, which may be stale: the
    connection may be closed already and its number reused, by another connection or
    by a listener that a resume bound again. shutdown(2) of a listening socket made
    libzmq's next accept fail with EINVAL, which it asserts on (`Invalid argument
    (src/tcp_listener.cpp:196)`, SIGABRT: the daemon gone). An inode names one socket
    for as long as it is open, so the guard shuts down only the one it saw accepted."""
    with borrowed(fd) as sock:
        return None if sock is None else socket_id(sock, listening=False)


def _shut_down(fd, connection_id):
    """Shut down `fd` if it is still the connection `connection_id` names (else leave it)."""
    with borrowed(fd) as sock:
        if sock is None or connection_id is None or socket_id(sock, listening=False) != connection_id:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False


class ConnectionGuard:
    """Watches a server's sockets; runs on its I/O thread (see the module docstring)."""

    def __init__(self, max_connections=DEFAULT_MAX_CONNECTIONS, max_per_peer=DEFAULT_MAX_PER_PEER,
                 fd_reserve=DEFAULT_FD_RESERVE, *, on_pause=None, on_resume=None, raise_limit=True,
                 idle_after=None, busy=None):
        for name, value in (("max_connections", max_connections), ("max_per_peer", max_per_peer),
                            ("fd_reserve", fd_reserve)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.fd_reserve = fd_reserve
        self.fd_limit = raise_fd_limit() if raise_limit else resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._on_pause, self._on_resume = on_pause, on_resume
        self._monitors = []              # (socket, its monitor, bytes sent once through the handshake, idle)
        self._live = {}                  # fd -> peer key of a connection we let in
        self._per_peer = collections.Counter()
        small_pool = max(4, min(DEFAULT_HANDSHAKE_BUDGET, self.admit_line // 4))
        self._handshakes = Handshakes(small_pool)
        self._doomed = set()             # fds shut down, their DISCONNECTED not seen yet
        self._accepted = []              # (fd, handshake threshold) accepted since the last settle()
        self._ids = {}                   # fd -> its connection's id when accepted (_connection_id)
        # Idle connections give way at a budget (module docstring): off unless the server
        # reports its requests. busy() -> descriptors with a request not yet answered.
        self._room = IdleRoom(idle_after, busy, small_pool)
        self.evicted_idle = 0
        self.dropped = 0
        self.dropped_in_handshake = 0    # of those: pushed out before their handshake was through
        self.paused = False
        self.pauses = 0                  # times the listeners stopped
        self.gates = Gates()
        self._recheck_at = 0.0
        self._check_at = 0.0             # monotonic time of the next look at the descriptors

    @property
    def held(self):
        """Connections held now (let in, in their handshake or waiting for their first
        request over a budget; not yet disconnected)."""
        return len(self._live) + len(self._handshakes) + len(self._room.waiting)

    @property
    def handshaking(self):
        return len(self._handshakes)

    def counts(self):
        """What a server's status reports of its connections."""
        return {"connections": self.held, "connections_dropped": self.dropped,
                "connections_evicted_idle": self.evicted_idle,
                "connections_handshaking": self.handshaking, "connections_waiting": len(self._room.waiting),
                "listening_paused": self.paused, "listening_pauses": self.pauses}

    def watch(self, sock, curve=False, idle=True):
        """Monitor `sock` (a CURVE server if `curve`); returns the monitor socket the I/O loop
        polls. `idle=False`: its connections send no requests (a PUB socket's subscribers),
        so silence does not make them idle."""
        configure(sock, self.fd_reserve)
        if not curve:
            sock.zap_domain = NULL_ZAP_DOMAIN
        # Not get_monitor_socket: its PAIR keeps the default high-water mark, and libzmq
        # drops monitor events beyond it. Under a flood a lost DISCONNECTED left a dropped
        # connection "doomed" for good, and the listeners paused for good with it.
        address = f"inproc://prefetchd-monitor-{next(_MONITORS)}"
        sock.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_LISTENING)
        mon = sock.context.socket(zmq.PAIR)
        mon.rcvhwm = 0                   # no limit: the I/O loop drains it at every poll
        mon.linger = 0
        mon.connect(address)
        self._monitors.append((sock, mon, THROUGH_CURVE if curve else THROUGH_NULL, idle))
        return mon

    def poll_items(self):
        return [(mon, lambda frames, through=through, idle=idle: self.on_monitor(frames, through, idle))
                for _, mon, through, idle in self._monitors]

    def on_monitor(self, frames, through=THROUGH_NULL, idle=True):
        if len(frames) != 2 or len(frames[0]) != 6:
            return
        event, fd = struct.unpack("=hi", frames[0])
        if event == zmq.EVENT_ACCEPTED:
            if self._ids.get(fd) is not None and self._ids[fd] == _connection_id(fd):
                return                   # taken in (or dropped) at its first request: see saw()
            self._gone(fd)               # the number is reused: its last connection is closed
            self._ids[fd] = _connection_id(fd)
            self._accepted.append((fd, through))
            if not idle:
                self._room.never_idle(fd)
        elif event == zmq.EVENT_DISCONNECTED:
            self._gone(fd)
        elif event == zmq.EVENT_LISTENING:
            self.gates.saw(frames[1].decode(errors="replace"), fd)

    def saw(self, fd):
        """A request arrived on connection `fd` (zmq.Frame.get(zmq.SRCFD) of its first frame).
        False if the guard dropped that connection: answer nothing on it. A request can come
        before its connection's ACCEPTED event: the connection is admitted or dropped at it."""
        if fd not in self._live:
            self.settle()                # what was accepted, first
        if fd in self._room.waiting:          # over a budget: in an idle one's place, or dropped
            key = self._room.waiting.pop(fd)
            self._admit(fd, key, open_descriptors(), through_handshake=True, requested=True)
        elif fd not in self._live and fd not in self._doomed:
            self._admit_at_first_request(fd)
        if fd in self._live:
            self._room.saw(fd)
            return True
        return fd not in self._doomed

    def _admit_at_first_request(self, fd):
        """A request came on a connection whose ACCEPTED event is not here yet (libzmq
        delivers monitor events late): admit or drop it now, by the descriptors in use
        now. Admitted only once the event came, a client served for a while was dropped if
        the process had taken descriptors meanwhile (the event is recognized: on_monitor)."""
        key = _peer_of(fd)
        if key is None:
            return
        self._ids[fd] = _connection_id(fd)
        self._handshakes.discard(fd)
        self._admit(fd, key, open_descriptors(), through_handshake=True, requested=True)

    def shut(self, fd):
        """Shut down connection `fd` now (its client may no longer be served); 1 if it was."""
        self._release(fd)
        return self._drop(fd)

    def _gone(self, fd):
        self._accepted = [item for item in self._accepted if item[0] != fd]
        self._handshakes.discard(fd)
        self._doomed.discard(fd)
        self._ids.pop(fd, None)
        self._release(fd)

    def _release(self, fd):
        """No longer count `fd` as a connection of ours (gone, or shut down for a new one)."""
        self._room.forget(fd)
        key = self._live.pop(fd, None)
        if key is not None:
            self._per_peer[key] -= 1
            if self._per_peer[key] <= 0:
                del self._per_peer[key]

    def settle(self):
        """Admit or drop what was accepted since the last call, and the tcp connections
        whose handshake is through since (after every poll)."""
        self._drain()            # every queued event first: a descriptor seen gone is not shut down
        self._forget_closed()
        through = self._handshakes.through()
        if self._accepted or through:
            in_use = open_descriptors()
            accepted, self._accepted = self._accepted, []
            for fd, threshold in accepted:
                key = _peer_of(fd)
                if key is None:
                    continue
                if key[0] == "addr":             # tcp: counted once through its handshake
                    for old in self._handshakes.add(fd, key, threshold):
                        self.dropped_in_handshake += self._drop(old)
                    continue
                self._admit(fd, key, in_use)
            for fd, key in through:
                self._admit(fd, key, in_use, through_handshake=True)
            in_use = open_descriptors()
            if not self.paused and in_use > self.pause_line:
                self._set_paused(True, in_use)
        self._check_descriptors()

    def _check_descriptors(self):
        """While paused, after every poll: resume once the descriptors in use (those that
        closed, and those of the connections dropped) are back at the admit line. Else at
        most every FD_CHECK_INTERVAL, accepts or not (the server's I/O loop ticks at least
        once a second): descriptors taken by anything else in the process (its application,
        the store) count too, so the listeners stop before a burst arrives rather than once
        libzmq accepted it into the last descriptors."""
        now = time.monotonic()
        if now < self._check_at and not self.paused:
            return
        self._check_at = now + FD_CHECK_INTERVAL
        in_use = open_descriptors()
        if not self.paused and in_use > self.pause_line:
            self._set_paused(True, in_use)
        elif self.paused and in_use <= self.admit_line:
            self._set_paused(False, None)

    def _forget_closed(self):
        """Now and then, forget the connections that are gone though no DISCONNECTED said
        so: an unbind (the pause of an endpoint no gate covers) closes the connections it
        accepted without one, and the guard went on counting them against their peer's
        budget."""
        now = time.monotonic()
        if now < self._recheck_at:
            return
        self._recheck_at = now + RECHECK_INTERVAL
        for fd in list(self._live) + list(self._doomed) + list(self._room.waiting):
            ident = self._ids.get(fd)
            if ident is None or _connection_id(fd) != ident:
                self._gone(fd)

    def _admit(self, fd, key, in_use, through_handshake=False, requested=False):
        """Let `fd` in, or drop it if it is beyond a budget (see the module docstring);
        over one, a connection without a request yet waits for it (idle_room)."""
        over = len(self._live) >= self.max_connections or self._per_peer[key] >= self.per_peer_budget
        waits = over and not requested and self._room.may_wait(fd)
        if over and not waits and not self._make_room(key):
            self._drop(fd)
            return
        # Descriptors already shut down leave as soon as libzmq sees it: a flood's churn
        # of them must not turn away a client whose handshake is through. Nor may the
        # connections still in their handshake: a client through it (for CURVE, its key
        # passed ZAP) goes first, and they give their descriptors up for it. Dropped
        # instead, it had sent its first request already, which was lost with it. Those
        # waiting over a budget for a first request go before either (idle_room): at a low
        # limit their descriptors turned away a client under every budget.
        while not waits and self._room.waiting and in_use - len(self._doomed) > self.admit_line:
            self._drop(self._room.push_out())
        while through_handshake and in_use - len(self._doomed) > self.admit_line:
            victim = self._handshakes.pop_victim()
            if victim is None:
                break
            self.dropped_in_handshake += self._drop(victim)
        if in_use - len(self._doomed) > self.admit_line:
            self._drop(fd)
            return
        if waits:
            for pushed in self._room.wait(fd, key):
                self._drop(pushed)
            return
        self._live[fd] = key
        self._room.saw(fd)
        self._per_peer[key] += 1

    def _make_room(self, key):
        """Shut down the idlest connection of the budget a new one from `key` is at (its
        peer's, else the total), if one is idle enough; True if it made room."""
        candidates = [fd for fd, peer in self._live.items() if peer == key] \
            if self._per_peer[key] >= self.per_peer_budget else self._live
        victim = self._room.victim(candidates)
        if victim is None:
            return False
        self._release(victim)           # its slot is free even if it closed meanwhile
        self.evicted_idle += self._drop(victim)
        return True

    def _drop(self, fd):
        if _shut_down(fd, self._ids.get(fd)):
            self._doomed.add(fd)
            self.dropped += 1
            return 1
        return 0

    @property
    def admit_line(self):
        """Descriptors in use above which a new connection is dropped."""
        return self.fd_limit - 2 * self.fd_reserve

    @property
    def pause_line(self):
        """Descriptors in use above which the listeners stop (only the store's reserve left)."""
        return self.fd_limit - self.fd_reserve

    @property
    def per_peer_budget(self):
        """max_per_peer, lowered at a low limit so that four peers fit under the admit line."""
        return max(1, min(self.max_per_peer, self.admit_line // 4))

    def _set_paused(self, paused, in_use):
        if paused:
            log.warning("prefetchd server: %d of %d descriptors in use; not accepting connections "
                        "until some close (%d dropped so far)", in_use, self.fd_limit, self.dropped)
        callback = self._on_pause if paused else self._on_resume
        if callback is not None:
            callback()
        # Counted once the listeners have stopped (or resumed): status read from another
        # thread never reports a pause whose socket file a new client can still find.
        self.paused = paused
        self.pauses += paused

    def _drain(self):
        for _, mon, through, idle in self._monitors:
            while True:
                try:
                    frames = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.on_monitor(frames, through, idle)

    def close(self):
        self.gates.open_all()
        for sock, mon, _, _ in self._monitors:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(linger=0)
        self._monitors.clear()
