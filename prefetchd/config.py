"""Configuration: defaults < TOML file < PREFETCHD_* environment < explicit arguments.

Sizes accept integers (bytes) or strings with IEC or SI units ("2GiB", "512MiB",
"1.5GB"); watermarks also accept fractions of the device budget (0.9). A bad
value raises ConfigError naming the key and where the value came from.
"""
import dataclasses
import ipaddress
import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass, fields

from .config_env import ENV_PREFIX, warn_unknown_env
from .config_tables import check_tables
from .errors import ConfigError
from .limits import default_host_budget

MAX_CONFIG_BYTES = 1 << 20  # a config file larger than this is not one

_UNITS = {"": 1, "b": 1,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
_MAX_SIZE = 1 << 50          # 1 PiB: larger is a typo, not a budget
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
PAGE = 4096                  # the smallest block any backend reserves: a smaller high watermark holds nothing

# Every numeric key's bounds, checked at load (Config.__post_init__): beyond them a value
# is a typo, or fails later and far from its cause (10**9 I/O queue slots are a bad_alloc
# at the first write, 5000 I/O threads are 5000 threads). None: no bound on that side.
BOUNDS = {
    "device_budget": (2 * PAGE, None),       # its default high watermark (95%) holds a page;
                                             # above: parse_size's 1 PiB
    "high_watermark": (PAGE, None),          # above: device_budget
    "host_budget": (0, None),
    "copy_streams": (1, 2),                  # a load stream and a store stream, or one for both
    "io_block_size": (PAGE, 256 << 20),
    "io_queue_depth": (1, 1024),
    "io_threads": (1, 256),
    "io_nice": (-20, 19),
    "lookahead": (0, 1024),
    "metrics_port": (0, 65535),
    "max_message_size": (1024, 1 << 30),
    "shutdown_timeout": (0, 24 * 3600),
}


def parse_size(value, key="size"):
    """Bytes from an int or a string like '2GiB'. Fractions are not sizes."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}")
        if value >= _MAX_SIZE:
            raise ConfigError(f"{key}: {value} bytes is beyond any machine (limit 1 PiB)")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return parse_size(int(value), key)      # the same limit as an int's
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n >= _MAX_SIZE:
                raise ConfigError(f"{key}: {value!r} is beyond any machine (limit 1 PiB)")
            if n == int(n):
                return int(n)
        if m and m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}: unknown unit {m.group(2)!r} in {value!r} (units: B, KiB, MiB, GiB, "
                              f"TiB, K, M, G, T, KB, MB, GB, TB; any case)")
        raise ConfigError(f"{key}: cannot read {value!r} as a size (examples: 1048576, '512MiB', '2GiB')")
    raise ConfigError(f"{key}: expected a size, got {type(value).__name__} {value!r}")


def parse_fraction_or_size(value, budget, key):
    """A watermark: a fraction in [0, 1] of `budget` ("90%", 0.9), or bytes ("900MiB", "9.4e8", 943718400)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            value = float(value.strip()[:-1]) / 100
        except ValueError:
            raise ConfigError(f"{key}: cannot read {value!r} as a percentage") from None
    if isinstance(value, str) and not value.strip().isdigit():    # "943718400": bytes, as in TOML
        try:
            value = float(value)
        except ValueError:
            return parse_size(value, key)
    if isinstance(value, float) and math.isfinite(value) and 0 <= value <= 1:
        return int(budget * value)
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer() and value > 1):
        raise ConfigError(f"{key}: expected a fraction of the budget in [0, 1] or whole bytes, got {value}")
    return parse_size(value, key)


def _parse_bool(value, key):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true/false, got {value!r}")


def _parse_int(value, key, minimum=None):
    try:
        if isinstance(value, bool):          # TOML `lookahead = true` is not 1
            raise ValueError
        n = int(value)
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if minimum is not None and n < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {n}")
    return n


def _parse_port(value, key):
    if value in (None, "", "none", "off"):
        return None
    port = _parse_int(value, key, minimum=0)
    if port > 65535:
        raise ConfigError(f"{key}: a TCP port is at most 65535, got {port}")
    return port


def _parse_seconds(value, key):
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected seconds, got a boolean")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{key}: must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def _parse_io_block(value, key):
    size = parse_size(value, key)
    if size < 4096 or size % 4096:
        raise ConfigError(f"{key}: must be a multiple of 4 KiB (direct I/O), at least 4096; got {size}")
    return size


def _parse_verify(value, key):
    if not _parse_bool(value, key):
        raise ConfigError(f"{key}: reads from the store are always verified (CRC32C); "
                          f"turning verification off is not supported")
    return True


_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def parse_name(value, key):
    """A daemon name (unset or empty: "default"); it names a socket file and metrics labels,
    so no '/' or '..'. Public: the CLI's --name checks its argument the same way."""
    name = _optional_str(value, key) or "default"
    if not _NAME_RE.match(name):
        raise ConfigError(f"{key}: {name!r} must be 1-64 characters of letters, digits, '_', '.', '-' "
                          f"(it names metrics labels and socket files)")
    return name


def ip_literal(text):
    """An IP address literal or "localhost" (a host name would fail only in the exporter)."""
    try:
        return text if text == "localhost" else str(ipaddress.ip_address(text))
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address (e.g. 127.0.0.1, ::1, 0.0.0.0)") from None


def _parse_ip(value, key):
    text = _optional_str(value, key)
    try:
        return None if text is None else ip_literal(text)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


_HOST_RE = re.compile(r"^(\*|[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*)$")


def is_tcp_port(text):
    """True for a tcp endpoint's port as written: a number from 0 to 65535, or '*' (any: bind only).
    The config parser and the clients' endpoint resolution (control/endpoints.py) share it."""
    return text == "*" or (text.isascii() and text.isdigit() and int(text) <= 65535)


def _parse_endpoint(value, key):
    """ipc://[path] or tcp://host:port, read now so that a bad one fails at load: the host
    an IPv4 address, an IPv6 address in brackets (tcp://[::1]:5555), '*' or a name."""
    text = _optional_str(value, key)
    if text is None or text in ("ipc", "default") or text.startswith("ipc://"):
        return text
    if not text.startswith("tcp://"):
        raise ConfigError(f"{key}: {text!r} is neither ipc://[path] nor tcp://host:port")
    host, sep, port = text[len("tcp://"):].rpartition(":")
    if not sep or not is_tcp_port(port):
        raise ConfigError(f"{key}: {text!r} needs a port from 0 to 65535 (tcp://127.0.0.1:5555)")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ConfigError(f"{key}: {host!r} in {text!r} is not an IPv6 address") from None
    elif ":" in host:
        raise ConfigError(f"{key}: an IPv6 host goes in brackets: tcp://[{host}]:{port}")
    elif host and not _HOST_RE.match(host):
        raise ConfigError(f"{key}: {host!r} in {text!r} is not an address or a host name")
    return text


def _check_bounds(config):
    for key, (low, high) in BOUNDS.items():
        value = getattr(config, key)
        if value is None or isinstance(value, bool):
            continue
        if (low is not None and value < low) or (high is not None and value > high):
            most = f" and at most {high}" if high is not None else ""
            raise ConfigError(f"{key}: {value} is out of bounds: must be at least {low}{most}")


def _choice(*allowed):
    def parse(value, key):
        if value not in allowed:
            raise ConfigError(f"{key}: must be one of {', '.join(allowed)}; got {value!r}")
        return value
    return parse


def _optional_str(value, key):
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


@dataclass(frozen=True)
class Config:
    """Everything a Daemon needs. Build with `Config.load(...)`; fields are final."""

    device_budget: int = 1 << 30          # bytes of the device tier prefetchd may reserve
    high_watermark: int | None = None     # reservations never exceed this (None -> 95% of budget)
    low_watermark: int | None = None      # eviction stops here (None -> 85% of the high watermark)
    host_budget: int | None = None        # bytes of host RAM (cache of the remote tier, host-tier
                                          # tensors); None: auto, limits.default_host_budget
    store_dir: str | None = None          # remote tier directory (None -> a private temp dir)
    backend: str = "cpu"
    copy_streams: int = 2                 # 2: write-backs on a stream of their own; 1: one for both
    io_engine: str = "auto"
    direct_io: bool = True
    huge_pages: bool = True               # cpu: transparent huge pages for device blocks of 2 MiB or more
    io_block_size: int = 8 << 20
    io_queue_depth: int = 8
    io_threads: int = 4
    io_nice: int = -10                    # cpu: nice of the copy-stream threads (disk reads, copies);
                                          # below 0 needs CAP_SYS_NICE or RLIMIT_NICE, else left as is
    fsync: bool = True
    verify_reads: bool = True
    lookahead: int = 2
    policy: str = "belady"
    auto_fetch: bool = False
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    endpoint: str | None = None           # ZeroMQ control plane (ipc:// or tcp://); None: not served
    curve_keys_dir: str | None = None     # tcp: CURVE keys from `prefetchd keys` (server + authorized clients)
    allow_remote: bool = False            # tcp: bind addresses other than loopback
    max_message_size: int = 1 << 20       # control-plane request size limit
    allow_insecure_remote: bool = False   # allow_remote without CURVE: every peer on the network may connect
    shared_host: str | None = None        # Unix socket of a shared host tier's owner (docs/shared-host.md):
                                          # clean host replicas come from it; None: a private host tier
    shared_host_map: bool = True          # cpu: map a shared block's pages under the device block (no copy)
                                          # where the kernel can move file mappings; false: copy (pread)
    trace: str | None = None              # write a Chrome/Perfetto timeline of the scheduler here at close()
    name: str = "default"
    shutdown_timeout: float = 10.0
    rank: int | None = None               # this daemon's rank in a sharded job (prefetchd/ranks.py:
    world_size: int | None = None         # rank_config sets both); None: not one of several ranks

    @classmethod
    def load(cls, path=None, env=None, **overrides):
        """Merge defaults < TOML file (`path` or $PREFETCHD_CONFIG) < env < overrides."""
        env = os.environ if env is None else env
        raw, origin = {}, {}
        path = path or env.get(ENV_PREFIX + "CONFIG")
        if path:
            for key, value in cls.load_section(path, "prefetchd").items():
                raw[key], origin[key] = value, f"file {path}"
        for key in cls.keys():
            name = ENV_PREFIX + key.upper()
            if name in env:
                raw[key], origin[key] = env[name], f"env {name}"
        warn_unknown_env(env, cls.keys())
        for key, value in overrides.items():
            if value is not None:
                raw[key], origin[key] = value, "argument"
        config = cls.from_dict(raw, origin)
        object.__setattr__(config, "_origins", dict(origin))
        return config

    def sources(self):
        """{key: where its value came from} for every key not left at its default."""
        return dict(getattr(self, "_origins", {}))

    @staticmethod
    def load_section(path, section):
        """The `[section]` table of a TOML file ({} if the file has none): the one TOML
        reader. For "prefetchd", a file without a [prefetchd] table is read flat (its
        top-level keys), as Config.load does. ConfigError names the file on any failure."""
        try:
            # Not a regular file (a FIFO would block the read forever, a directory fails later):
            # refused before it is opened.
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ConfigError(f"config file {path}: not a regular file")
            if os.path.getsize(path) > MAX_CONFIG_BYTES:
                raise ConfigError(f"config file {path}: larger than {MAX_CONFIG_BYTES} bytes")
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except RecursionError:
            raise ConfigError(f"config file {path}: nested too deeply to be a prefetchd config") from None
        check_tables(doc, path)
        if section in doc:
            table = doc[section]
            if not isinstance(table, dict):
                raise ConfigError(f"config file {path}: [{section}] must be a table")
            return table
        if section == "prefetchd":
            return {k: v for k, v in doc.items() if not isinstance(v, dict)}
        return {}

    @classmethod
    def keys(cls):
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, raw, origin=None):
        origin = origin or {}
        unknown = sorted(set(raw) - set(cls.keys()))
        if unknown:
            where = origin.get(unknown[0], "argument")
            raise ConfigError(f"{unknown[0]}: unknown setting (from {where}); known: {', '.join(cls.keys())}")
        values = {}
        for key, value in raw.items():
            parse = _PARSERS[key]
            try:
                values[key] = parse(value, key)
            except ConfigError as e:
                where = origin.get(key)
                raise ConfigError(f"{e} (from {where})" if where else str(e)) from None
        budget = values.get("device_budget", cls.device_budget)
        for key in ("high_watermark", "low_watermark"):
            if key in values:
                try:
                    values[key] = parse_fraction_or_size(values[key], budget, key)
                except ConfigError as e:
                    where = origin.get(key)
                    raise ConfigError(f"{e} (from {where})" if where else str(e)) from None
        try:
            return cls(**values)
        except ConfigError as e:            # a bound or a relation: name where the key came from
            where = origin.get(str(e).partition(":")[0])
            raise ConfigError(f"{e} (from {where})" if where else str(e)) from None

    def __post_init__(self):
        high = self.high_watermark if self.high_watermark is not None else int(self.device_budget * 0.95)
        low = self.low_watermark if self.low_watermark is not None else int(high * 0.85)
        object.__setattr__(self, "high_watermark", high)
        _check_bounds(self)
        if high > self.device_budget:
            raise ConfigError(f"high_watermark: {high} bytes exceeds device_budget {self.device_budget}")
        if low > high:
            raise ConfigError(f"low_watermark: {low} bytes is above high_watermark {high}")
        if (self.rank is None) != (self.world_size is None):   # "key:" first: load() names its origin
            key, other = ("rank", "world_size") if self.world_size is None else ("world_size", "rank")
            raise ConfigError(f"{key}: {getattr(self, key)} is set without {other}; the two are set together")
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank: {self.rank} is outside the world of {self.world_size} ranks")
        object.__setattr__(self, "low_watermark", low)
        if self.host_budget is None:
            object.__setattr__(self, "host_budget", default_host_budget(self.backend, self.device_budget))

    def replace(self, **changes):
        config = Config.from_dict({**self.as_dict(), **changes})
        object.__setattr__(config, "_origins", {**self.sources(), **dict.fromkeys(changes, "argument")})
        return config

    def as_dict(self):
        return dataclasses.asdict(self)


_PARSERS = {}


def _keep_watermark(value, key):
    # Watermarks are resolved against the (possibly overridden) budget in from_dict.
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a fraction or a size, got a boolean")
    return value


_PARSERS.update({
    "device_budget": parse_size,
    "high_watermark": _keep_watermark,
    "low_watermark": _keep_watermark,
    "host_budget": lambda v, k: None if v in (None, "auto") else parse_size(v, k),
    "store_dir": _optional_str,
    "backend": _choice("cpu", "ascend", "ascend-vmm"),
    "copy_streams": _parse_int,
    "io_engine": _choice("auto", "aio", "threads", "buffered"),
    "direct_io": _parse_bool,
    "huge_pages": _parse_bool,
    "io_block_size": _parse_io_block,
    "io_queue_depth": _parse_int,
    "io_threads": _parse_int,
    "io_nice": _parse_int,
    "fsync": _parse_bool,
    "verify_reads": _parse_verify,
    "lookahead": _parse_int,
    "policy": _choice("lru", "belady"),
    "auto_fetch": _parse_bool,
    "metrics_port": _parse_port,
    "metrics_addr": _parse_ip,
    "endpoint": _parse_endpoint,
    "curve_keys_dir": _optional_str,
    "allow_remote": _parse_bool,
    "allow_insecure_remote": _parse_bool,
    "shared_host": _optional_str,
    "shared_host_map": _parse_bool,
    "trace": _optional_str,
    "max_message_size": parse_size,
    "name": parse_name,
    "shutdown_timeout": lambda v, k: _parse_seconds(v, k),
    "rank": lambda v, k: None if v in (None, "") else _parse_int(v, k, minimum=0),
    "world_size": lambda v, k: None if v in (None, "") else _parse_int(v, k, minimum=1),
})
