"""Every numeric setting is bounded at load, and addresses are read at load: a value that
would fail later (a bad_alloc at the first write for io_queue_depth=10**9, 5000 threads,
a watermark that holds nothing, a metrics address that is no address, a tcp endpoint
libzmq cannot bind) is a ConfigError naming the key, the value, the bound and where the
value came from. tcp://[::1] passed the loopback check, then failed with "No such
device"; it is served now (libzmq's IPV6 option)."""
import urllib.request

import numpy as np
import pytest

import prefetchd
from prefetchd.config import BOUNDS, Config
from prefetchd.control import Client
from prefetchd.errors import ConfigError

TOO_FAR = [
    ("io_queue_depth", 10 ** 9, "at least 1 and at most 1024"),
    ("io_threads", 5000, "at least 1 and at most 256"),
    ("copy_streams", 1000, "at least 1 and at most 2"),
    ("copy_streams", 3, "at least 1 and at most 2"),       # (was taken, and meant 2)
    ("io_nice", 20, "at least -20 and at most 19"),
    ("io_nice", -21, "at least -20 and at most 19"),
    ("high_watermark", 1, "at least 4096"),
    ("lookahead", 10 ** 9, "at least 0 and at most 1024"),
    ("shutdown_timeout", 1e300, "at least 0 and at most 86400"),
    ("io_block_size", "1TiB", "at least 4096 and at most 268435456"),
    ("max_message_size", "2GiB", "at most 1073741824"),
    ("device_budget", 4096, "at least 8192"),
    ("io_threads", 0, "at least 1 and at most 256"),
    ("copy_streams", 0, "at least 1 and at most 2"),
]


@pytest.mark.parametrize("key,value,bound", TOO_FAR, ids=[f"{k}={v}" for k, v, _ in TOO_FAR])
def test_a_value_beyond_its_bound_is_refused_at_load_naming_key_value_and_bound(key, value, bound):
    with pytest.raises(ConfigError) as err:
        Config.load(env={}, **{key: value})
    message = str(err.value)
    assert message.startswith(f"{key}: ") and bound in message and "(from argument)" in message, message
    shown = value if isinstance(value, (int, float)) else None
    assert shown is None or str(shown) in message, message


def test_the_environment_and_files_are_named_as_the_source(tmp_path):
    with pytest.raises(ConfigError, match=r"io_threads: 5000 .* \(from env PREFETCHD_IO_THREADS\)"):
        Config.load(env={"PREFETCHD_IO_THREADS": "5000"})
    path = tmp_path / "p.toml"
    path.write_text("[prefetchd]\ncopy_streams = 1000\n")
    with pytest.raises(ConfigError, match=rf"copy_streams: 1000 .* \(from file {path}\)"):
        Config.load(path=str(path), env={})


def test_the_bounds_themselves_load():
    highest = {key: high for key, (low, high) in BOUNDS.items() if high is not None}
    config = Config.load(env={}, **highest)
    for key, value in highest.items():
        assert getattr(config, key) == value
    assert Config.load(env={}, device_budget=8192).high_watermark >= 4096
    assert Config.load(env={}, device_budget="1MiB", high_watermark=4096).high_watermark == 4096


def test_a_watermark_that_holds_nothing_is_refused_at_runtime_too(make_daemon):
    daemon = make_daemon(device_budget="1MiB")
    with pytest.raises(ValueError, match=r"high watermark 1 must be in \[4096,"):
        daemon.set_watermarks(1)
    daemon.set_watermarks(4096).result(10)


def test_a_watermark_reads_the_same_from_a_file_the_environment_and_an_argument(tmp_path):
    # A file's `low_watermark = 0` silently became the default (85%) while the environment's
    # "0" was refused; the environment's "943718400" was refused as a fraction above 1 while
    # the file's 943718400 was bytes. Whole numbers are bytes and 0 is 0 everywhere.
    budget = 1 << 30
    path = tmp_path / "p.toml"
    for key, value, want in (("low_watermark", 0, 0), ("high_watermark", 943718400, 943718400),
                             ("low_watermark", "0.5", budget // 2),
                             ("high_watermark", "90%", int(budget * 0.9))):
        literal = f'"{value}"' if isinstance(value, str) else value
        path.write_text(f"[prefetchd]\ndevice_budget = {budget}\n{key} = {literal}\n")
        env = {"PREFETCHD_DEVICE_BUDGET": str(budget), f"PREFETCHD_{key.upper()}": str(value)}
        readings = {getattr(Config.load(path=str(path), env={}), key),
                    getattr(Config.load(env=env), key),
                    getattr(Config.load(env={}, device_budget=budget, **{key: value}), key)}
        assert readings == {want}, (key, value, readings)
    # Every written form of a whole number is bytes, and 0, 0.0 and 0% are 0 (9.4e8 in TOML, "1e9"
    # in the environment and `ctl set-watermarks 1e7` were refused as fractions above 1).
    for value, want in (("943718400.0", 943718400), ("+943718400", 943718400), ("1e9", 10 ** 9),
                        ("943_718_400", 943718400), (9.4e8, 940000000), ("0.0", 0), ("0%", 0), (0.0, 0)):
        assert Config.load(env={}, device_budget=budget << 1, low_watermark=value).low_watermark == want, value
    for value in ("150%", "-1", "nan", 1.5, "inf"):
        with pytest.raises(ConfigError, match="expected a fraction of the budget in \\[0, 1\\] or whole bytes"):
            Config.load(env={}, low_watermark=value)
    for where in ({"env": {"PREFETCHD_HIGH_WATERMARK": "0"}}, {"env": {}, "high_watermark": 0}):
        with pytest.raises(ConfigError, match="high_watermark: 0 is out of bounds: must be at least 4096"):
            Config.load(**where)
    assert Config.load(env={}, device_budget=budget).low_watermark == int(int(budget * 0.95) * 0.85)


@pytest.mark.parametrize("addr", ["not-an-ip", "127.0.0.256", "::1::", "http://127.0.0.1"])
def test_a_metrics_address_that_is_no_ip_address_is_refused_at_load(addr):
    with pytest.raises(ConfigError, match=rf"metrics_addr: '{addr}' is not an IP address"):
        Config.load(env={}, metrics_addr=addr)


@pytest.mark.parametrize("endpoint,says", [
    ("tcp://::1:5555", r"an IPv6 host goes in brackets: tcp://\[::1\]:5555"),
    ("tcp://[::g]:5555", r"'\[::g\]' in 'tcp://\[::g\]:5555' is not an IPv6 address"),
    ("tcp://127.0.0.1", "needs a port from 0 to 65535"),
    ("tcp://127.0.0.1:70000", "needs a port from 0 to 65535"),
    ("tcp://127.0.0.1:\u0665\u0665\u0665\u0665", "needs a port from 0 to 65535"),   # Arabic-Indic 5555: isdigit()
    ("tcp://exa mple:5555", "is not an address or a host name"),
    ("udp://127.0.0.1:5555", "is neither ipc://"),
])
def test_a_bad_endpoint_is_refused_at_load(endpoint, says):
    with pytest.raises(ConfigError, match="endpoint: .*" + says):
        Config.load(env={}, endpoint=endpoint)


def test_a_client_refuses_a_port_of_non_ascii_digits_as_the_config_does():
    from prefetchd.control.endpoints import resolve_endpoint
    assert resolve_endpoint("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    with pytest.raises(ConfigError, match="the port must be a number from 0 to 65535"):
        resolve_endpoint("tcp://127.0.0.1:\u0665\u0665\u0665\u0665")


def test_ipv6_loopback_is_served_and_exported(store_dir, ms):
    with prefetchd.Daemon(store_dir=store_dir, device_budget="1MiB", name="v6", endpoint="tcp://[::1]:0",
                          metrics_addr="::1", metrics_port=0) as daemon:
        daemon.register(ms.Tensor(np.ones(256, np.float32)), name="w", tier="remote")
        endpoint = daemon.attachments.server.endpoint      # what config.endpoint bound
        assert endpoint.startswith("tcp://[::1]:"), endpoint
        with Client(endpoint, timeout=10) as client:
            assert client.ping()["pong"] is True
            assert client.prefetch(["w"])["done"] is True
            assert [t["name"] for t in client.list("w")] == ["w"]
        body = urllib.request.urlopen(f"http://[::1]:{daemon.metrics_port}/metrics", timeout=10).read()
        assert b"prefetchd_" in body
