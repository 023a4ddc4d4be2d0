"""Every command and flag of README.md's command table runs once, at small sizes, as a user
would type it (issue #30: `bench io --sweep` was in the table and failed at once, and no test
ran it). The table is parsed here, so a row or a flag added to README.md without a case below
fails `test_every_readme_command_and_flag_has_a_case`, naming it.

From the table: each row's first cell gives its commands (`bench io\\|sched` is two) and
flags every one of them takes; a flag in the description belongs to the command named last
before it in that cell (`model --steady`, `accelerate` ... `--torch-python`), else to every
command of the row. "Every command takes `--version`, ..." gives flags any one case may cover.
`serve`, `status` and `ctl` run against a real `prefetchd serve` started here.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from _bench_serve_report import check_quick_report
from helpers import ENV, REPO, wait_until

README = os.path.join(REPO, "README.md")
SMALL_DEMO = ("--size", "24MiB", "--hidden", "256", "--passes", "1", "--seq", "8")
SERVE_MODEL = dict(hidden=64, layers=2, batch=2, seq=8)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z.]*$")          # CKPT, DIR, FILE, FILE.png


# ----------------------------------------------------------------------------- the table

def _code_spans(cell):
    return [s.replace("\\|", "|") for s in re.findall(r"`([^`]+)`", cell)]


def _commands(span):
    """(commands, flags) of a first-cell span: `prefetchd bench io\\|sched --json`."""
    words = span.split()
    assert words[0] == "prefetchd", span
    path, flags = [[]], []
    for w in words[1:]:
        if w.startswith("--"):
            flags.append(w)
        elif not PLACEHOLDER.match(w) and not flags:
            path = [p + [alt] for p in path for alt in w.split("|")]
    return [" ".join(p) for p in path], flags


def readme_requirements():
    """{(command, flag or None)}: each command once, each flag with its command; flags of
    the "Every command takes" sentence as ("*", flag)."""
    text = open(README).read()
    section = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    need = set()
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 2 or cells[0] == "command" or set(cells[0]) <= set("-: "):
            continue
        commands, row_flags = _commands(_code_spans(cells[0])[0])
        for command in commands:
            need.add((command, None))
            need.update((command, f) for f in row_flags)
        current = commands
        for span in _code_spans(cells[1]):
            words = span.split()
            named = [c for c in commands if c.split()[-1] == words[0]]
            if named:
                current = named
            for w in words:
                if w.startswith("--"):
                    need.update((c, w) for c in current)
    sentence = re.search(r"Every command takes ([^\n]*(?:\n[^\n]+)*?)[;.]", section)
    assert sentence, "README's command section lost its 'Every command takes' sentence"
    need.update(("*", f) for f in re.findall(r"`(--[a-z-]+)`", sentence.group(1)))
    return need


# ----------------------------------------------------------------------------- the cases

@dataclass
class Case:
    id: str
    argv: list                       # after `prefetchd`; {tmp} {ckpt} {safetensors} {endpoint} {worker}
    check: object = None             # check(out, paths) beyond exit status 0 and no traceback
    code: int = 0
    timeout: float = 240
    server: bool = False             # needs the `prefetchd serve` below
    env: dict = field(default_factory=dict)
    logs_tracebacks: bool = False    # soak injects listener failures; they are logged with theirs

    def command(self):
        return " ".join(w for w in self.argv if not w.startswith("-"))


def _json(out):
    return json.loads(out.stdout)


def _check_demo(out, paths):
    doc = _json(out)
    assert doc["outputs_match"] and doc["watermark_respected"], doc
    assert (doc["tier"], doc["lookahead"], doc["batch"]) == ("host", 1, 2), doc
    assert doc["device_budget"] <= doc["model_bytes"] // 4 + 4096, doc
    assert json.load(open(paths["tmp"] + "/demo-trace.json"))["traceEvents"]


def _check_bench_serve(out, paths):
    check_quick_report(_json(out))      # the whole report: this is the suite's one run of it


def _check_plot(out, paths):
    try:
        import matplotlib  # noqa: F401
    except ImportError:          # the extra is not installed here: refused before the run, saying so
        assert out.returncode == 1 and "prefetchd[plot]" in out.stderr, out.stderr
        return
    assert out.returncode == 0 and os.path.getsize(paths["tmp"] + "/demo.png") > 0


def _check_io(out, paths):
    rows = _json(out)["filestore"]
    assert rows and all(min(r["read_MBps"]["samples"]) > 0 for r in rows), rows


def _check_sweep(out, paths):
    assert len(_json(out)["filestore"]) == 32


def _check_infer(out, paths):
    y = np.load(paths["tmp"] + "/out/output0.npy")
    assert y.shape[:2] == (SERVE_MODEL["batch"], SERVE_MODEL["seq"]) and np.isfinite(y).all(), y.shape
    assert "output0.npy\tfloat32\t[2, 8, " in out.stdout, out.stdout


def _check_validate(out, paths):
    assert out.stdout.strip() == "configuration OK", out.stdout


def _has(*keys):
    def check(out, paths):
        doc = _json(out)
        assert all(k in doc for k in keys), sorted(doc)
    return check


def _check_sched(out, paths):
    doc = _json(out)
    assert {"resident_hits", "queued_pin_unpin", "streaming_64MiB", "many_tensors", "targets"} <= set(doc)
    many = doc["many_tensors"]
    assert sorted(int(k) for k in many["by_size"]) == many["sizes"] and many["size_ratio"] == 8
    assert all(v["us_per_load"] > 0 for v in many["by_size"].values())
    assert "load_cost_within_1.5x_at_8x_tensors" in doc["targets"]


def _check_soak(out, paths):
    doc = _json(out)
    assert doc["ok"] and doc["data_mismatches"] == 0 and doc["checksum_failures"] == 0, doc


def _check_stage(out, paths):
    doc = _json(out)
    assert doc["tensors"] == 2 and doc["generation"] == 1, doc


def _check_sharded(out, paths):
    doc = _json(out)
    assert doc["world_size"] == 2 and doc["generation"] == 1 and sorted(doc["ranks"]) == ["0", "1"], doc
    for rank in ("0", "1"):
        assert os.path.isdir(os.path.join(doc["store"], f"rank_{rank}")), doc


def _check_accelerate(out, paths):
    if out.returncode == 1:     # no torch here: one line naming the interpreter and what it lacks
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot `import torch, accelerate`" in lines[0], out.stderr
        return
    assert "ratios" in json.dumps(_json(out)) or _json(out), out.stdout


def _check_status(out, paths):
    doc = _json(out)
    assert doc["front"]["endpoint"] == paths["endpoint"] and doc["workers"][0]["ready"], doc


def _check_ctl_ping(out, paths):
    assert _json(out)["pong"] is True


def _check_ctl_list(out, paths):
    assert _json(out), out.stdout       # the worker's daemon holds the staged tensors


def _check_keys(out, paths):
    keys = paths["tmp"] + "/keys"
    assert sorted(os.listdir(keys)) == ["authorized_clients", "client.key", "client.key_secret",
                                        "server.key", "server.key_secret"]
    assert os.listdir(keys + "/authorized_clients") == ["client.key"]


def _check_version(out, paths):
    assert out.stdout.startswith("prefetchd "), out.stdout


def _check_debug(out, paths):
    assert out.returncode == 1 and "Traceback" in out.stderr and "no such file" in out.stderr


def _torch_python():
    return os.environ.get("PREFETCHD_TORCH_PYTHON") or sys.executable


BENCH = ("--json", "--repeats", "1", "--dir", "{tmp}")
CASES = [
    Case("demo", ["demo", *SMALL_DEMO, "--budget", "25%", "--batch", "2", "--lookahead", "1", "--tier", "host",
                  "--metrics-port", "0", "--trace", "{tmp}/demo-trace.json", "--json"], _check_demo, timeout=300),
    Case("demo-plot", ["demo", *SMALL_DEMO, "--plot", "{tmp}/demo.png", "--json"], _check_plot, code=None),
    Case("bench-io", ["bench", "io", *BENCH, "--size", "1MiB", "--no-drop-caches"], _check_io),
    Case("bench-io-sweep", ["bench", "io", *BENCH, "--size", "1MiB", "--no-drop-caches", "--sweep"], _check_sweep),
    Case("bench-sched", ["bench", "sched", *BENCH, "--requests", "2000"], _check_sched),
    Case("bench-model", ["bench", "model", *BENCH, "--size", "1MiB", "--hidden", "128", "--batch", "1",
                         "--steady"], _has("device_budget", "model_bytes")),
    Case("bench-serve", ["bench", "serve", "--quick", "--json", "--dir", "{tmp}"], _check_bench_serve,
         timeout=400),
    Case("bench-soak", ["bench", "soak", *BENCH, "--seconds", "3"], _check_soak, logs_tracebacks=True),
    Case("bench-accelerate", ["bench", "accelerate", *BENCH, "--size", "1MiB", "--hidden", "128",
                              "--torch-python", _torch_python()], _check_accelerate, code=None, timeout=300),
    Case("stage-ckpt", ["stage", "{ckpt}", "--store", "{tmp}/store-ckpt", "--json"], _check_stage),
    Case("stage-safetensors", ["stage", "{safetensors}", "--store", "{tmp}/store-st", "--json", "--quiet"],
         _check_stage),
    Case("stage-shard-split", ["stage", "{ckpt}", "--store", "{tmp}/store-split", "--shard", "w=1",
                               "--ranks", "2", "--json", "--quiet"], _check_sharded),
    Case("stage-shard-per-rank", ["stage", "{per_rank}", "--store", "{tmp}/store-per-rank", "--shard",
                                  "per-rank", "--json", "--quiet"], _check_sharded),
    Case("collect-env", ["collect-env", "--json", "--log-level", "INFO"], _has("native", "io_probe")),
    Case("keys", ["keys", "{tmp}/keys"], _check_keys),
    Case("serve", ["serve", "--model", "prefetchd.serve.spec:demo_model", "--checkpoint-store", "{served}"],
         server=True),
    Case("status", ["status", "--endpoint", "{endpoint}", "--json"], _check_status, server=True),
    Case("ctl-ping", ["ctl", "--endpoint", "{endpoint}", "ping"], _check_ctl_ping, server=True),
    Case("ctl-list", ["ctl", "--endpoint", "{worker}", "list"], _check_ctl_list, server=True),
    Case("infer", ["infer", "--endpoint", "{endpoint}", "--model", "m0", "{x_npy}", "--out", "{tmp}/out"],
         _check_infer, server=True),
    Case("config-show", ["config", "show", "--json"], _has("device_budget", "store_dir")),
    Case("config-validate", ["config", "validate"], _check_validate),
    Case("version", ["--version"], _check_version),
    Case("debug", ["--debug", "stage", "{tmp}/missing.ckpt", "--store", "{tmp}/nostore"], _check_debug, code=1),
]


def test_every_readme_command_and_flag_has_a_case():
    need = readme_requirements()
    assert ("bench io", "--json") in need and ("bench accelerate", "--torch-python") in need   # the parser works
    covered = set()
    for case in CASES:
        flags = {w.split("=")[0] for w in case.argv if w.startswith("--")}
        words = case.command()
        for command, flag in need:
            if command == "*" or words == command or words.startswith(command + " "):
                if flag is None or flag in flags:
                    covered.add((command, flag))
    missing = sorted(need - covered, key=str)
    assert not missing, f"README.md's command table has commands/flags no case here runs: {missing}"


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import mindspore as ms
    d = tmp_path_factory.mktemp("readme-ckpt")
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(4, dtype=np.int64)}
    ckpt = str(d / "model.ckpt")
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in tensors.items()], ckpt)
    sys.path.insert(0, os.path.join(REPO, "tests", "staging"))
    from ckpt_files import write_safetensors
    st = str(d / "model.safetensors")
    write_safetensors(st, tensors)
    per_rank = d / "per-rank"                # MindSpore's distributed layout: rank_<N>/<file>.ckpt
    for rank in range(2):
        (per_rank / f"rank_{rank}").mkdir(parents=True)
        ms.save_checkpoint([{"name": k, "data": ms.Tensor(v[..., rank::2])} for k, v in tensors.items()],
                           str(per_rank / f"rank_{rank}" / "net.ckpt"))
    x_npy = str(d / "x.npy")                 # an input of the served demo model
    np.save(x_npy, np.zeros((SERVE_MODEL["batch"], SERVE_MODEL["seq"], SERVE_MODEL["hidden"]), np.float32))
    return {"ckpt": ckpt, "safetensors": st, "per_rank": str(per_rank), "x_npy": x_npy}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real `prefetchd serve` (one worker) over a staged demo-model checkpoint."""
    import mindspore as ms
    from prefetchd.serve.spec import ServeSpec, demo_model
    d = tmp_path_factory.mktemp("readme-serve")
    cell, _ = demo_model(seed=3, spec=ServeSpec(models=1, **SERVE_MODEL))
    ms.save_checkpoint(cell, str(d / "demo.ckpt"))
    store = str(d / "staged")
    out = _run(["stage", str(d / "demo.ckpt"), "--store", store, "--quiet"], timeout=120)
    assert out.returncode == 0, out.stderr
    endpoint = f"ipc://{d}/front.sock"
    serve = next(c for c in CASES if c.id == "serve")
    argv = [a.replace("{served}", store) for a in serve.argv]
    argv += ["--endpoint", endpoint, "--workers", "1", "--store", str(d / "workers"),
             *(w for k, v in SERVE_MODEL.items() for w in (f"--{k}", str(v)))]
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd.cli", *argv], env=ENV, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from prefetchd.control import Client, RequestTimeout

    def up():
        if proc.poll() is not None:
            return True
        try:
            with Client(endpoint, timeout=1) as c:
                return c.ping()["workers"] == 1
        except RequestTimeout:
            return False
    try:
        assert wait_until(up, 120, 0.25) and proc.poll() is None, proc.communicate(timeout=5)[1][-3000:]
        with Client(endpoint, timeout=10) as c:
            worker = c.status()["workers"][0]["control"]
        yield {"endpoint": endpoint, "worker": worker, "proc": proc}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _run(argv, timeout=240, env=None):
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", *argv], env=dict(ENV, **(env or {})),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_readme_command_runs(case, request, tmp_path, checkpoints):
    paths = {"tmp": str(tmp_path), **checkpoints}
    if case.server:
        served = request.getfixturevalue("served")
        paths.update(endpoint=served["endpoint"], worker=served["worker"])
        if case.id == "serve":          # the fixture ran it: still up, and it answers an inference
            from prefetchd.serve import Client as ServeClient
            x = np.zeros((SERVE_MODEL["batch"], SERVE_MODEL["seq"], SERVE_MODEL["hidden"]), np.float32)
            with ServeClient(served["endpoint"], timeout=60) as c:
                (y,) = c.infer("m0", x)
            assert served["proc"].poll() is None and np.isfinite(y).all()
            return
    argv = [a.format(**paths) if "{" in a else a for a in case.argv]
    started = time.monotonic()
    out = _run(argv, case.timeout, case.env)
    seconds = time.monotonic() - started
    if case.code is not None:
        assert out.returncode == case.code, f"prefetchd {' '.join(argv)}: exit {out.returncode}\n{out.stderr[-3000:]}"
    if case.code == 0 and not case.logs_tracebacks:
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
    if case.check:
        case.check(out, paths)
    assert seconds < case.timeout
