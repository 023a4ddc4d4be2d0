"""Security promises of the control plane: private ipc sockets, loopback tcp by
default, CURVE for tcp (unauthenticated peers get no service), key files that
only their owner can read, and a refusal to use a directory someone else owns.
"""
import os
import sys
import secrets
import stat

import pytest
import zmq

from prefetchd.control import protocol as P
from prefetchd.errors import ConfigError
from prefetchd.control import Client, RequestTimeout, Server, create_keys, runtime_dir
from prefetchd.socket_dirs import ensure_private_dir
from prefetchd.control.keys import AUTHORIZED_DIR


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    import mindspore as ms
    import numpy as np

    import prefetchd

    d = prefetchd.Daemon(device_budget=1 << 20, name="sec",
                         store_dir=str(tmp_path_factory.mktemp("sec-store"))).start()
    d.register(ms.Tensor(np.ones((16, 16), np.float32)), name="w", tier="remote")
    yield d
    d.close(5)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return create_keys(str(tmp_path_factory.mktemp("keys") / "curve"), clients=("client", "other"))


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_default_ipc_socket_is_private(daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    server = Server(daemon, "ipc://").start()
    try:
        path = server.endpoint[len("ipc://"):]
        assert path == f"{tmp_path}/prefetchd/sec.sock"
        assert mode(os.path.dirname(path)) == 0o700
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert mode(path) & 0o077 == 0                       # bound under umask 0177
        events = server.events_endpoint[len("ipc://"):]
        assert mode(events) & 0o077 == 0
        assert os.lstat(os.path.dirname(path)).st_uid == os.getuid()
        with Client(server.endpoint, timeout=5) as c:
            assert c.ping()["pong"]
    finally:
        server.close(2)
    assert not os.path.exists(path)


def test_fallback_runtime_dir_is_private(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = runtime_dir()
    assert path == f"/tmp/prefetchd-{os.getuid()}"
    assert mode(path) == 0o700


def test_umask_is_restored_after_bind(daemon):
    before = os.umask(0o022)
    os.umask(before)
    server = Server(daemon, f"ipc://sec-{secrets.token_hex(3)}.sock").start()
    server.close(2)
    after = os.umask(before)
    assert after == before


def test_explicit_ipc_directory_is_created_private(daemon, tmp_path):
    path = tmp_path / "run" / "ctl.sock"
    server = Server(daemon, f"ipc://{path}").start()
    try:
        assert mode(path.parent) == 0o700
        assert mode(path) & 0o077 == 0
    finally:
        server.close(2)


def test_private_dir_checks(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    ensure_private_dir(str(loose))
    assert mode(loose) == 0o700                              # ours: tightened
    link = tmp_path / "link"
    link.symlink_to(loose)
    with pytest.raises(ConfigError, match="not a directory"):
        ensure_private_dir(str(link))
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(ConfigError, match="belongs to uid"):
            ensure_private_dir(str(foreign))


def test_tcp_binds_loopback_unless_told_otherwise(daemon):
    with pytest.raises(ConfigError, match="loopback"):
        Server(daemon, "tcp://0.0.0.0:0")
    with pytest.raises(ConfigError, match="loopback"):
        Server(daemon, "tcp://*:0")
    server = Server(daemon, "tcp://localhost:0").start()
    try:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        assert server.events_endpoint.startswith("tcp://127.0.0.1:")
    finally:
        server.close(2)


def test_key_files_are_private(keys):
    assert mode(keys) == 0o700
    assert mode(os.path.join(keys, AUTHORIZED_DIR)) == 0o700
    for name in ("server.key_secret", "client.key_secret", "other.key_secret"):
        assert mode(os.path.join(keys, name)) == 0o600
    assert sorted(os.listdir(os.path.join(keys, AUTHORIZED_DIR))) == ["client.key", "other.key"]


def test_curve_server_needs_its_certificate(daemon, tmp_path):
    with pytest.raises(ConfigError, match="prefetchd keys"):
        Server(daemon, "tcp://127.0.0.1:0", curve_keys_dir=str(tmp_path))


@pytest.mark.parametrize("loose, chmod", [("", 0o777), ("", 0o775), (AUTHORIZED_DIR, 0o777),
                                          ("server.key_secret", 0o644), ("server.key_secret", 0o640)])
def test_a_keys_directory_others_could_change_is_refused(daemon, tmp_path, loose, chmod):
    # Whoever can write authorized_clients/ admits their own key (it is read again at every
    # handshake); whoever can read server.key_secret can pose as the server.
    keys = create_keys(str(tmp_path / "curve"))
    path = os.path.join(keys, loose) if loose else keys
    os.chmod(path, chmod)
    with pytest.raises(ConfigError, match=f"{path} has mode {chmod:o}: another local user could"):
        Server(daemon, "tcp://127.0.0.1:0", curve_keys_dir=keys)
    create_keys(keys)                     # the remedy the refusal names
    Server(daemon, "tcp://127.0.0.1:0", curve_keys_dir=keys).start().close(2)


def test_a_kubernetes_secret_volume_with_fs_group_is_accepted(daemon, tmp_path):
    """kubelet mounts a Secret read-only, files root-owned and, with fsGroup, 0440 root:GID
    (defaultMode 0400 becomes 0440): deploy/kubernetes runs as a non-root user with fsGroup.
    A read-only mount cannot be written, and root's file its group reads is the pod's."""
    import subprocess
    import pathlib
    import tempfile
    keys = create_keys(str(tmp_path / "made"))
    mount = pathlib.Path(tempfile.mkdtemp(prefix="pfd-secret-"))   # (tmp_path is root's, 0700)
    os.chmod(mount, 0o755)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        os.rmdir(mount)
        pytest.skip(f"cannot mount tmpfs here: {mounted.stderr.strip()}")
    try:
        os.makedirs(mount / AUTHORIZED_DIR)
        for name in ("server.key", "server.key_secret", os.path.join(AUTHORIZED_DIR, "client.key")):
            with open(os.path.join(keys, name), "rb") as f, open(mount / name, "wb") as g:
                g.write(f.read())
            os.chown(mount / name, 0, 10001)
            os.chmod(mount / name, 0o440)
        os.chmod(mount / AUTHORIZED_DIR, 0o755)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        probe = (f"import os; from prefetchd.control.keys import check_server_keys; "
                 f"os.setgid(10001); os.setuid(10001); check_server_keys({str(mount)!r}); "
                 f"open({str(mount / 'server.key_secret')!r}).read(); print('accepted')")
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert run.stdout.strip() == "accepted", run.stderr[-2000:]
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        os.rmdir(mount)


def test_authorized_keys_others_could_write_admit_nobody(tmp_path, caplog):
    from prefetchd.control.keys import AuthorizedKeys
    keys = create_keys(str(tmp_path / "curve"), clients=("client", "other"))
    authorized = os.path.join(keys, AUTHORIZED_DIR)
    public = {name: zmq.auth.load_certificate(os.path.join(keys, f"{name}.key"))[0]
              for name in ("client", "other")}
    os.chmod(os.path.join(authorized, "other.key"), 0o666)     # a file anyone could rewrite
    admitted = AuthorizedKeys(authorized)
    assert admitted.callback("prefetchd", public["client"])
    assert not admitted.callback("prefetchd", public["other"])
    assert "other.key has mode 666" in caplog.text
    os.chmod(authorized, 0o777)                                 # loosened while serving
    assert not admitted.callback("prefetchd", public["client"])
    os.chmod(authorized, 0o700)
    assert admitted.callback("prefetchd", public["client"])


@pytest.fixture(scope="module")
def curve_server(daemon, keys):
    server = Server(daemon, "tcp://127.0.0.1:0", curve_keys_dir=keys).start()
    yield server
    server.close(2)


def test_authorized_curve_client_is_served(curve_server, keys):
    with Client(curve_server.endpoint, timeout=5,
                server_public_key=os.path.join(keys, "server.key"),
                client_keys=os.path.join(keys, "client.key_secret")) as c:
        assert c.ping()["pong"]
        assert c.status()["server"]["curve"] is True
        with c.subscribe() as sub:
            sub.sync()
            c.prefetch("w")
            assert sub.recv(timeout=5)["name"] == "w"


@pytest.mark.parametrize("who", ["plain", "ephemeral_key", "wrong_server_key", "stolen_public"])
def test_unauthenticated_tcp_clients_get_no_service(curve_server, keys, who):
    served_before = sum(curve_server.counters.requests.values())
    malformed_before = curve_server.counters.malformed
    kwargs = {}
    if who == "ephemeral_key":                    # right server, unknown client key
        kwargs = {"server_public_key": os.path.join(keys, "server.key")}
    elif who == "wrong_server_key":               # authorized client, impostor server key
        kwargs = {"server_public_key": zmq.curve_keypair()[0],
                  "client_keys": os.path.join(keys, "client.key_secret")}
    elif who == "stolen_public":                  # knows an authorized public key, not its secret
        public, _ = zmq.auth.load_certificate(os.path.join(keys, "client.key"))
        kwargs = {"server_public_key": os.path.join(keys, "server.key"),
                  "client_keys": (public, zmq.curve_keypair()[1])}
    with Client(curve_server.endpoint, timeout=0.7, **kwargs) as c:
        with pytest.raises(RequestTimeout):
            c.ping()
        with pytest.raises(RequestTimeout):
            c.prefetch("w")
    assert sum(curve_server.counters.requests.values()) == served_before
    assert curve_server.counters.malformed == malformed_before


def test_unauthenticated_subscriber_gets_no_events(curve_server, keys):
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(curve_server.events_endpoint)
        with Client(curve_server.endpoint, timeout=5,
                    server_public_key=os.path.join(keys, "server.key"),
                    client_keys=os.path.join(keys, "client.key_secret")) as c:
            for _ in range(5):
                c.call("ping", sync="x")
                c.evict("w")
                c.prefetch("w")
        assert not sub.poll(500)
    finally:
        ctx.destroy(linger=0)


def test_raw_frames_from_a_plain_peer_are_never_parsed(curve_server):
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(curve_server.endpoint)
        sock.send_multipart(P.encode_request(P.new_rid(1), "status"))
        sock.send_multipart([b"garbage"])
        assert not sock.poll(700)
    finally:
        ctx.destroy(linger=0)
