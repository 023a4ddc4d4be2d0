"""CURVE keys of the control plane: the certificate layout `prefetchd keys DIR`
makes, loading keys, and the server side of CURVE (a ZAP authenticator that
admits only the public keys in DIR/authorized_clients, re-read when they change:
AuthorizedKeys)."""
import logging
import os
import shutil
import stat
import threading
import time

import zmq
import zmq.auth

from ..errors import ConfigError

SERVER_SECRET = "server.key_secret"
SERVER_PUBLIC = "server.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED_DIR = "authorized_clients"
ZAP_DOMAIN = "prefetchd"


def load_key(value, what):
    """A z85 key from bytes/str, or the `what` ("public"/"secret") half of a certificate file."""
    if isinstance(value, str) and os.path.exists(value):
        public, secret = zmq.auth.load_certificate(value)
        return secret if what == "secret" and secret else public
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or len(value) != 40:
        raise ConfigError(f"{what} key: expected a 40-character z85 key or a certificate path")
    return value


def client_curve(server_public_key, client_keys):
    """(server public, client public, client secret) for a Client; an ephemeral
    client pair when `client_keys` is None (an authorizing server refuses it)."""
    server_key = load_key(server_public_key, "public")
    if client_keys is None:
        public, secret = zmq.curve_keypair()
    elif isinstance(client_keys, (tuple, list)):
        public, secret = (load_key(k, w) for k, w in zip(client_keys, ("public", "secret")))
    else:
        public, secret = zmq.auth.load_certificate(client_keys)
        if secret is None:
            raise ConfigError(f"client_keys: {client_keys} holds no secret key")
    return server_key, public, secret


def _too_open(path, mask):
    """Why `path` cannot be trusted with keys (another user owns it, or its mode has a
    bit of `mask`), or None."""
    st = os.stat(path)
    if st.st_uid not in (os.getuid(), 0):
        return f"belongs to uid {st.st_uid}, not to us ({os.getuid()})"
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        mask &= ~0o222          # nobody writes on a read-only mount (a Kubernetes Secret volume)
    if st.st_uid == 0 and os.getuid() != 0:
        mask &= ~0o040          # root's file its group reads: a Secret volume with fsGroup (0440 root:GID)
    if stat.S_IMODE(st.st_mode) & mask:
        return f"has mode {stat.S_IMODE(st.st_mode):o}"
    return None


def check_server_keys(directory):
    """Refuse a keys directory another local user could change: whoever can write
    authorized_clients/ (or the directory holding it) admits their own key, since the
    server reads it again at every handshake; whoever can read server.key_secret can
    pose as the server. The rule ssh applies to its keys."""
    secret = os.path.join(directory, SERVER_SECRET)
    if not os.path.exists(secret):
        raise ConfigError(f"curve_keys_dir: {directory} has no {SERVER_SECRET} "
                          f"(create it with `prefetchd keys {directory}`)")
    authorized = os.path.join(directory, AUTHORIZED_DIR)
    checks = [(directory, 0o022, "chmod go-w"), (secret, 0o077, "chmod 600")]
    if os.path.isdir(authorized):
        checks.insert(1, (authorized, 0o022, "chmod go-w"))
    for path, mask, fix in checks:
        why = _too_open(path, mask)
        if why is not None:
            raise ConfigError(f"curve_keys_dir: {path} {why}: another local user could "
                              f"{'read the server secret' if path == secret else 'admit a key of their own'} "
                              f"({fix} {path}, or make the keys again with `prefetchd keys`)")


class AuthorizedKeys:
    """The public keys of DIR/authorized_clients/*.key, as they are now: a key removed
    there is refused and one added is admitted without a restart (they were read once, at
    the server's start). The ZAP thread asks `callback` at every CURVE handshake, which
    reads the directory again (a listing and a stat per file: handshakes are few); the
    server's I/O thread asks `allows` at every request, which looks again when the
    directory's mtime changed and at least once a second (a key file rewritten in place
    leaves the directory's mtime alone)."""

    RECHECK = 1.0                         # seconds between full looks on the request path

    def __init__(self, directory):
        self.directory = directory
        self._lock = threading.Lock()
        self._keys = frozenset()
        self._listing = self._dir_stamp = None
        self._checked = 0.0
        self.refresh()

    def _stamp(self):
        try:
            st = os.stat(self.directory)
            return st.st_ino, st.st_mtime_ns
        except OSError:
            return None

    def _list(self):
        """(name, inode, mtime, size, too open) of each key file; or why none is read
        (also when the directory became writable by others since the start)."""
        try:
            why = _too_open(self.directory, 0o022)
            if why is not None:
                return f"the directory {why}"
            with os.scandir(self.directory) as entries:
                return tuple(sorted((e.name, e.inode(), e.stat().st_mtime_ns, e.stat().st_size,
                                     _too_open(e.path, 0o022))
                                    for e in entries if e.name.endswith(".key") and e.is_file()))
        except OSError as e:
            return str(e)

    def refresh(self, full=True):
        """Read the keys again if the directory changed (`full=False`: only if its mtime
        changed or RECHECK seconds passed since the last look)."""
        now, stamp = time.monotonic(), self._stamp()
        if not full and stamp == self._dir_stamp and now - self._checked < self.RECHECK:
            return
        with self._lock:
            self._dir_stamp, self._checked = stamp, now
            listing = self._list()
            if listing == self._listing:
                return
            keys = set()
            if isinstance(listing, str):
                _auth_log.error("authorized clients: cannot read %s (%s): no client is "
                                "admitted", self.directory, listing)
            for name, *_, too_open in () if isinstance(listing, str) else listing:
                if too_open is not None:
                    _auth_log.warning("authorized clients: %s %s, so others could have written "
                                      "it; not admitted", name, too_open)
                    continue
                try:
                    public, _ = zmq.auth.load_certificate(os.path.join(self.directory, name))
                except (OSError, ValueError) as e:
                    _auth_log.warning("authorized clients: %s is not a certificate (%s); "
                                      "not admitted", name, e)
                    continue
                if public:
                    keys.add(public)
            if self._listing is not None:
                _auth_log.info("authorized clients: %s changed; %d keys admitted now",
                               self.directory, len(keys))
            self._keys, self._listing = frozenset(keys), listing

    def callback(self, domain, key):
        """ZAP (pyzmq's credentials provider): is the z85 `key` authorized now?"""
        self.refresh()
        return key in self._keys

    def allows(self, user_id):
        """Is a request's client, by its ZAP User-Id (the z85 public key), still authorized?"""
        self.refresh(full=False)
        return (user_id or "").encode() in self._keys


_auth_log = logging.getLogger("prefetchd.control.auth")


def start_authenticator(ctx, directory):
    """(authenticator, (public, secret), AuthorizedKeys) of a CURVE server using `directory`."""
    from zmq.auth.thread import ThreadAuthenticator
    public, secret = zmq.auth.load_certificate(os.path.join(directory, SERVER_SECRET))
    authorized = AuthorizedKeys(os.path.join(directory, AUTHORIZED_DIR))
    auth = ThreadAuthenticator(ctx, log=_auth_log)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=authorized)
    return auth, (public, secret), authorized


def make_curve_server(sock, curve):
    sock.curve_publickey, sock.curve_secretkey = curve
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    # Refuse connections if the authenticator is not there (libzmq would let them in).
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def create_keys(directory, clients=("client",)):
    """Server and client CURVE certificates in `directory` (0700; secrets 0600).

    Layout: server.key / server.key_secret, <client>.key / <client>.key_secret,
    and authorized_clients/<client>.key holding the public keys the server accepts. An
    existing directory is taken only if it holds nothing else (it is made private: never
    /tmp or a project directory).
    """
    _refuse_shared_dir(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    authorized = os.path.join(directory, AUTHORIZED_DIR)
    os.makedirs(authorized, mode=0o700, exist_ok=True)
    os.chmod(authorized, 0o700)                # (made again over a loose one: the server refuses it)
    old = os.umask(0o077)
    try:
        if not os.path.exists(os.path.join(directory, SERVER_SECRET)):
            zmq.auth.create_certificates(directory, "server")
        for client in clients:
            if not os.path.exists(os.path.join(directory, f"{client}.key_secret")):
                zmq.auth.create_certificates(directory, client)
            shutil.copyfile(os.path.join(directory, f"{client}.key"),
                            os.path.join(authorized, f"{client}.key"))
    finally:
        os.umask(old)
    for name in os.listdir(directory):         # also secrets it did not make (loosened since)
        if name.endswith(".key_secret"):
            os.chmod(os.path.join(directory, name), 0o600)
    return directory


def _refuse_shared_dir(directory):
    """ConfigError if `directory` exists and holds anything but certificates: making it
    private (0700) would lock everyone else out of their files."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        raise ConfigError(f"keys: cannot read {directory}: {e.strerror}") from None
    other = sorted(n for n in names if n != AUTHORIZED_DIR and not _is_certificate(os.path.join(directory, n)))
    if other:
        shown = ", ".join(repr(n) for n in other[:3]) + (", ..." if len(other) > 3 else "")
        raise ConfigError(f"keys: {directory} holds other files ({shown}); a keys directory is made "
                          f"private (0700) and holds only CURVE certificates: give a new directory")


def _is_certificate(path):
    """A ZeroMQ CURVE certificate file (NAME.key or NAME.key_secret) this command made: a TLS
    server.key of the same name is not one, and would be overwritten."""
    if not path.endswith((".key", ".key_secret")) or not os.path.isfile(path) or os.path.islink(path):
        return False
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError, zmq.ZMQError):
        return False
    return public is not None and len(public) == 40
