"""CLI commands of the ZeroMQ control plane; prefetchd.cli calls `register(subparsers)`.

    prefetchd status [--endpoint EP] [--json]            one daemon, or a serve front and its workers
    prefetchd ctl [--endpoint EP] OP [NAMES...]          ping|list|stats|prefetch|evict|pin|renew|
                                                         unpin|flush|set-watermarks
    prefetchd keys DIR [--client NAME ...]               CURVE certificates for tcp endpoints
    prefetchd serve [--workers N] [--endpoint EP] ...    front + N spawned inference workers
    prefetchd bench serve --json                         (via prefetchd.bench.runner -> bench_serve)

The endpoint defaults to the configured `endpoint` (--config / PREFETCHD_ENDPOINT),
else ipc://$XDG_RUNTIME_DIR/prefetchd/<name>.sock. For a CURVE-protected tcp
endpoint pass --curve-dir DIR (the directory `prefetchd keys` made): the client
then uses DIR/server.key and DIR/client.key_secret.
"""
import json
import os
import random
import sys
import time


def register(subparsers):
    p = subparsers.add_parser("status", help="residency, memory and queue of a running daemon or serve front")
    _client_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("ctl", help="send one control-plane request (prints the JSON reply)")
    _client_args(p)
    p.add_argument("op", choices=["ping", "list", "stats", "prefetch", "evict", "pin", "renew", "unpin",
                                  "flush", "set-watermarks"])
    p.add_argument("args", nargs="*",
                   help="tensor names or globs (prefetch/evict/pin/flush/list), a lease id "
                        "(renew/unpin), or HIGH [LOW] (set-watermarks: bytes, 2GiB or 0.9)")
    p.add_argument("--lease", type=float, default=30.0, help="pin: lease seconds (renew before it ends)")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--no-wait", action="store_true", help="prefetch/evict/flush: reply once queued")
    p.set_defaults(func=cmd_ctl)

    p = subparsers.add_parser("keys", help="create CURVE certificates for a tcp control endpoint")
    p.add_argument("dir")
    p.add_argument("--client", action="append", default=None,
                   help="client certificate name (repeatable; default: client)")
    p.set_defaults(func=cmd_keys)

    p = subparsers.add_parser("serve", help="multi-process inference server: a front and N workers")
    p.add_argument("--config", help="TOML file (default: $PREFETCHD_CONFIG): [prefetchd] for the "
                                    "workers' daemons, [serve] for these options")
    p.add_argument("--endpoint", help="front endpoint for inference clients (default ipc://serve.sock "
                                      "in the runtime directory)")
    p.add_argument("--workers", type=int, help="worker processes (2)")
    p.add_argument("--models", type=int, help="weight sets per worker, m0, m1, ... (2)")
    p.add_argument("--hidden", type=int, help="demo model width (256)")
    p.add_argument("--layers", type=int, help="demo model blocks (4)")
    p.add_argument("--batch", type=int, help="batch of a request (4)")
    p.add_argument("--seq", type=int, help="sequence length of a request (16)")
    p.add_argument("--budget", type=float,
                   help="device budget of a worker in units of one model's weights (default: the "
                        "configured device_budget, else 1.5)")
    p.add_argument("--lookahead", type=int, help="units prefetched ahead, and covered by a hint (2)")
    p.add_argument("--store", help="root of the workers' stores (default: the configured store_dir, "
                                   "else a temporary directory)")
    p.add_argument("--no-hints", dest="hints", action="store_false", default=None,
                   help="do not send prefetch hints to workers")
    p.add_argument("--request-timeout", type=float, help="seconds before a request gets TIMEOUT (30)")
    p.add_argument("--metrics-port", type=int,
                   help="export the front's and all workers' metrics on this port (0: any free one)")
    p.add_argument("--metrics-addr", help="address of the metrics port (127.0.0.1)")
    p.set_defaults(func=cmd_serve)


def _client_args(p):
    p.add_argument("--endpoint", help="control endpoint (default: configured endpoint, else the "
                                      "default ipc socket of --name)")
    p.add_argument("--name", default=None, help="daemon name for the default ipc endpoint")
    p.add_argument("--config", help="TOML file (default: $PREFETCHD_CONFIG)")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--curve-dir", help="directory made by `prefetchd keys` (server.key, client.key_secret)")


def _client(args):
    from .config import Config
    from .service import Client

    endpoint, name = args.endpoint, args.name
    if endpoint is None or name is None:
        config = Config.load(args.config)
        endpoint = endpoint or config.endpoint
        name = name or config.name
    kwargs = {}
    if args.curve_dir:
        kwargs = {"server_public_key": os.path.join(args.curve_dir, "server.key"),
                  "client_keys": os.path.join(args.curve_dir, "client.key_secret")}
    return Client(endpoint, timeout=args.timeout, name=name, **kwargs)


# ----------------------------------------------------------------------------- status

def _bytes(n):
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _daemon_lines(st, indent=""):
    dev = st.get("device", {})
    states = st.get("states", {})
    srv = st.get("server", {})
    lines = [
        f"{indent}daemon   {st.get('name')}{' (closing)' if st.get('closed') else ''}, "
        f"backend {st.get('backend')}, io {st.get('io_engine')}",
        f"{indent}device   {_bytes(dev.get('used'))} / {_bytes(dev.get('capacity'))} "
        f"({100 * dev.get('usage_ratio', 0):.1f}%), peak {_bytes(dev.get('peak'))}, "
        f"watermarks {_bytes(dev.get('high_watermark'))} / {_bytes(dev.get('low_watermark'))}",
        f"{indent}tensors  {st.get('tensors')} (" + ", ".join(f"{k} {v}" for k, v in states.items())
        + f"); pinned {st.get('pinned')} ({_bytes(st.get('pinned_bytes'))})",
        f"{indent}queue    depth {st.get('queue_depth')}, in flight {st.get('in_flight')}",
    ]
    if srv:
        lines.append(f"{indent}server   {srv.get('endpoint')}: outstanding {srv.get('outstanding')}, "
                     f"leases {srv.get('leases')}, busy {srv.get('busy')}, "
                     f"malformed {srv.get('malformed')}, timeouts {srv.get('timeouts')}")
    return lines


def format_status(st):
    if "front" in st:
        front = st["front"]
        lines = [f"serve front {front['endpoint']} (pid {front['pid']}), hints "
                 f"{'on' if front['hints'] else 'off'}, queued {front['queued']}, "
                 f"models {', '.join(front['models'])}",
                 "counters " + ", ".join(f"{k} {v}" for k, v in sorted(front["counters"].items()))]
        for w in st["workers"]:
            lines.append(f"worker {w['index']}: pid {w['pid']}, {'ready' if w['ready'] else 'starting'}, "
                         f"in flight {w['inflight']}, served {w['served']}, failed {w['failed']}, "
                         f"deaths {w['deaths']}, last model {w['last_model']}")
            daemon = w.get("daemon") or {}
            if "error" in daemon:
                lines.append(f"  daemon: {daemon['error']}")
            else:
                lines.extend(_daemon_lines(daemon, "  "))
        return "\n".join(lines)
    return "\n".join(_daemon_lines(st))


def cmd_status(args):
    with _client(args) as client:
        st = client.status()
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print(format_status(st))
    return 0


# ----------------------------------------------------------------------------- ctl

def _target(values):
    if len(values) == 1 and any(c in values[0] for c in "*?["):
        return {"pattern": values[0]}
    if any(any(c in v for c in "*?[") for v in values):
        raise SystemExit("prefetchd ctl: give one glob or a list of exact names")
    return {"names": values}


def cmd_ctl(args):

    op, values = args.op, args.args
    with _client(args) as c:
        if op in ("ping", "stats"):
            result = c.call(op)
        elif op == "list":
            result = c.list(values[0] if values else "*")
        elif op in ("prefetch", "evict", "pin"):
            if not values:
                raise SystemExit(f"prefetchd ctl {op}: name the tensors (names or one glob)")
            extra = {"lease": args.lease} if op == "pin" else {"wait": not args.no_wait}
            if op == "prefetch":
                extra["priority"] = args.priority
            result = c.call(op, **_target(values), **extra)
        elif op == "flush":
            result = c.call("flush", wait=not args.no_wait, **(_target(values) if values else {}))
        elif op in ("renew", "unpin"):
            if not values:
                raise SystemExit(f"prefetchd ctl {op}: give the lease id that pin printed")
            result = c.call(op, lease=values)
        else:  # set-watermarks
            if not 1 <= len(values) <= 2:
                raise SystemExit("prefetchd ctl set-watermarks HIGH [LOW]")
            high, low = (_watermark(v) for v in (values + [None])[:2])
            result = c.set_watermarks(high, low)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _watermark(text):
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


# ----------------------------------------------------------------------------- keys

def cmd_keys(args):
    from .service import AUTHORIZED_DIR, create_keys

    clients = args.client or ["client"]
    directory = create_keys(args.dir, clients)
    print(f"server certificate: {os.path.join(directory, 'server.key_secret')} (keep private)")
    print(f"server public key:  {os.path.join(directory, 'server.key')} (give to clients)")
    for c in clients:
        print(f"client {c}: {os.path.join(directory, c + '.key_secret')}, authorized in "
              f"{os.path.join(directory, AUTHORIZED_DIR)}")
    print(f"serve with:   daemon.serve('tcp://127.0.0.1:5555', curve_keys_dir={directory!r})")
    print(f"connect with: prefetchd status --endpoint tcp://127.0.0.1:5555 --curve-dir {directory}")
    return 0


# ----------------------------------------------------------------------------- serve

SERVE_DEFAULTS = {"endpoint": None, "workers": 2, "models": 2, "hidden": 256, "layers": 4,
                  "batch": 4, "seq": 16, "budget": None, "lookahead": 2, "store": None,
                  "hints": True, "request_timeout": 30.0, "metrics_port": None,
                  "metrics_addr": "127.0.0.1"}


def serve_options(args):
    """Options of `prefetchd serve`: flags > the [serve] table of the config file > defaults."""
    import tomllib

    from .config import ENV_PREFIX, ConfigError

    path = args.config or os.environ.get(ENV_PREFIX + "CONFIG")
    table = {}
    if path:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f).get("serve", {})
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        unknown = sorted(set(table) - set(SERVE_DEFAULTS))
        if unknown:
            raise ConfigError(f"[serve] {unknown[0]}: unknown setting (from file {path}); known: "
                              f"{', '.join(SERVE_DEFAULTS)}")
    options = {}
    for key, default in SERVE_DEFAULTS.items():
        flag = getattr(args, key, None)
        options[key] = flag if flag is not None else table.get(key, default)
    options["config"] = path
    return options


def cmd_serve(args):
    import logging

    from .server import Front, ServeSpec

    o = serve_options(args)
    level = logging.getLogger().getEffectiveLevel()
    spec = ServeSpec(models=o["models"], hidden=o["hidden"], layers=o["layers"], batch=o["batch"],
                     seq=o["seq"], budget=o["budget"], lookahead=o["lookahead"],
                     store_dir=o["store"], log_level=logging.getLevelName(level),
                     config_path=o["config"])
    front = Front(o["endpoint"], workers=o["workers"], spec=spec, hints=o["hints"],
                  request_timeout=o["request_timeout"], metrics_port=o["metrics_port"],
                  metrics_addr=o["metrics_addr"])
    print(f"prefetchd serve: starting {o['workers']} workers; front on {front.endpoint}"
          + (f"; metrics on {o['metrics_addr']}:{o['metrics_port']}"
             if o["metrics_port"] is not None else ""), file=sys.stderr)
    front.serve_forever()
    return 0


# ----------------------------------------------------------------------------- bench serve

def _percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[k]


def run_load(endpoint, models, requests, concurrency, hint, seed=0, timeout=60.0):
    """Closed-loop load: `concurrency` requests outstanding, models drawn at random.

    Returns {"requests", "errors", "seconds", "rps", "p50_seconds", "p99_seconds", ...}.
    """
    import zmq

    from . import protocol as P

    rng = random.Random(seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    latencies, errors, sent, outstanding = [], {}, 0, {}
    started = time.perf_counter()
    try:
        while sent < requests or outstanding:
            while sent < requests and len(outstanding) < concurrency:
                rid = P.new_rid(sent)
                body = {"model": rng.choice(models), "seed": rng.randrange(4), "hint": hint}
                sock.send_multipart(P.encode_request(rid, "infer", body, timeout))
                outstanding[rid] = time.perf_counter()
                sent += 1
            if not sock.poll(int(timeout * 1000)):
                errors["NO_REPLY"] = errors.get("NO_REPLY", 0) + len(outstanding)
                break
            rid, doc = P.decode_reply(sock.recv_multipart())
            t0 = outstanding.pop(rid, None)
            if t0 is None:
                continue
            if doc.get("ok"):
                latencies.append(time.perf_counter() - t0)
            else:
                errors[doc.get("code")] = errors.get(doc.get("code"), 0) + 1
    finally:
        ctx.destroy(linger=0)
    seconds = time.perf_counter() - started
    return {"requests": requests, "completed": len(latencies), "errors": errors,
            "seconds": seconds, "rps": len(latencies) / seconds if seconds else 0.0,
            "p50_seconds": _percentile(latencies, 0.50), "p99_seconds": _percentile(latencies, 0.99),
            "mean_seconds": sum(latencies) / len(latencies) if latencies else None}


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def bench_serve(args):
    """`prefetchd bench serve`: requests/s and latency p50/p99 with and without prefetch hints.

    Starts a front and `--workers` workers in-process, then alternates phases with
    hints off and on (`--repeats` each, `--requests` per phase, default 60; models
    `--hidden` wide, default 256). Three weight sets per worker, picked at random per
    request, so most requests switch models. Both modes run against the same warm workers, so the
    ratios compare like with like on a noisy machine.
    """
    from .model import estimate_bytes
    from .server import Front, ServeSpec

    workers = max(1, int(getattr(args, "workers", 2) or 2))
    hidden = getattr(args, "hidden", None) or 256
    layers = getattr(args, "layers", None) or 4
    requests = getattr(args, "requests", None) or 60
    repeats = max(1, int(getattr(args, "repeats", 2) or 2))
    models = 3
    model_bytes = estimate_bytes(hidden, layers)
    # --budget is a fraction of a worker's weights (all its models), as for `bench model`,
    # but at least 1.25 models: one model streaming plus room for the hinted next one.
    fraction = getattr(args, "budget", 0.5) or 0.5
    spec = ServeSpec(models=models, hidden=hidden, layers=layers,
                     budget=max(fraction * models, 1.25), lookahead=getattr(args, "lookahead", 2) or 2,
                     store_dir=getattr(args, "dir", None))
    concurrency = 2 * workers
    front = Front(f"ipc://bench-serve-{os.getpid()}.sock", workers=workers, spec=spec,
                  request_timeout=120.0, name=f"bench-{os.getpid()}")
    phases = {"no_hints": [], "hints": []}
    front.start()
    try:
        names = spec.model_names()
        run_load(front.endpoint, names, 2 * models * workers, concurrency, False, seed=99)  # warm-up
        for r in range(repeats):
            for mode, hint in (("no_hints", False), ("hints", True)):
                phases[mode].append(run_load(front.endpoint, names, requests, concurrency, hint,
                                             seed=r))
        counters = dict(front.counters)
    finally:
        front.close()

    def summary(runs):
        return {"rps": _median([x["rps"] for x in runs]),
                "p50_seconds": _median([x["p50_seconds"] for x in runs]),
                "p99_seconds": _median([x["p99_seconds"] for x in runs]),
                "errors": sum(sum(x["errors"].values()) for x in runs), "runs": runs}

    off, on = summary(phases["no_hints"]), summary(phases["hints"])

    def ratio(a, b):
        return a / b if a and b else None

    return {"kind": "serve", "workers": workers, "models": models, "hidden": hidden,
            "layers": layers, "model_bytes": model_bytes, "device_budget_bytes": spec.device_budget(),
            "requests_per_phase": requests, "repeats": repeats, "concurrency": concurrency,
            "no_hints": off, "hints": on,
            "ratios": {"rps": ratio(on["rps"], off["rps"]),
                       "p50": ratio(on["p50_seconds"], off["p50_seconds"]),
                       "p99": ratio(on["p99_seconds"], off["p99_seconds"])},
            "front": counters, "ok": off["errors"] == 0 and on["errors"] == 0}
