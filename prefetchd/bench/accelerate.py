"""`prefetchd bench accelerate`: prefetchd against Accelerate's `disk_offload`, one interleaved run.

Same shape on both sides: a stack of `layers` Linear/Dense(hidden, hidden) layers, fp32, the
same weights (numpy, seed 0, as `bench model` builds them) and the same input (batch x hidden).
Methods, their passes interleaved round-robin (the start rotates each round):
  torch_resident   PyTorch, the model in RAM                        (child process)
  accelerate       PyTorch + accelerate.big_modeling.disk_offload: weights saved to an
                   offload folder as memmapped .dat files, loaded per module by its hooks;
                   page cache warm (never dropped; pass 0 reads the disk)    (child process)
  ms_resident      MindSpore, the model in RAM                      (this process)
  prefetchd        MindSpore + prefetchd, README usage: Daemon(device_budget=25% of the
                   weights, store_dir=...), offload(model, daemon, lookahead=2), weights on the
                   remote tier, host cache at its default budget (the model fits: after pass 0
                   every load is a copy from RAM)                   (this process)
Pass 0 of every method is timed and reported apart (`first_pass`); medians over passes 1..N.

torch/accelerate live in another interpreter (`--torch-python`, or $PREFETCHD_TORCH_PYTHON, or
this one if it imports both). That child runs for the whole bench and computes only when told,
over a line protocol on its stdin/stdout:
  child  -> "ready {json}"                      models built, disk_offload done
  parent -> "pass METHOD I"   child -> "done METHOD I SECONDS CPU_SECONDS DIGEST"
  parent -> "save PATH"       child -> "saved PATH"   (last outputs as .npz, for the checks)
  parent -> "quit"            child -> "bye"
  child  -> "error MESSAGE"   on any failure
so only one process computes at a time. Both sides use the same number of threads.

The child's script, the protocol and the shared weights are accelerate_child.py, which imports
nothing from prefetchd (the torch interpreter need not have it installed).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from . import accelerate_child as child_script
from .accelerate_child import (CHILD_METHODS, METHODS, PARENT_METHODS, TARGET_SPEEDUP, TORCH_PYTHON_ENV,
                               ProtocolError, SetupError, _check_error, _digest, bench_input, format_reply, format_request,
                               parse_ready, parse_reply, parse_request, ratios, weights)

__all__ = ["bench_accelerate", "find_torch_python", "run", "CHILD_METHODS", "METHODS", "PARENT_METHODS",
           "ProtocolError", "SetupError", "bench_input", "format_reply", "format_request", "parse_ready",
           "parse_reply", "parse_request", "ratios", "weights", "TARGET_SPEEDUP", "TORCH_PYTHON_ENV"]


# -- the parent --------------------------------------------------------------------------------

def _imports_torch(python):
    try:
        return subprocess.run([python, "-c", "import torch, accelerate"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_torch_python(explicit=None, env=None):
    """The interpreter to run the Accelerate side: --torch-python, else $PREFETCHD_TORCH_PYTHON,
    else this one if it imports torch and accelerate; SetupError (one line) otherwise."""
    env = os.environ if env is None else env
    for given, source in ((explicit, "--torch-python"), (env.get(TORCH_PYTHON_ENV), TORCH_PYTHON_ENV)):
        if given:
            if not _imports_torch(given):
                raise SetupError(f"{source}={given}: that interpreter cannot `import torch, accelerate`")
            return given
    if _imports_torch(sys.executable):
        return sys.executable
    raise SetupError("bench accelerate needs an interpreter with torch and accelerate: "
                     "python3.11 -m venv /tmp/accel-venv && /tmp/accel-venv/bin/pip install torch accelerate "
                     f"'numpy<2', then --torch-python /tmp/accel-venv/bin/python (or ${TORCH_PYTHON_ENV})")


class TorchSide:
    """The child process: both torch methods, alive for the whole bench."""

    def __init__(self, python, cfg, log_path):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([python, os.path.abspath(child_script.__file__), "--child", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, cwd=cfg["offload_dir"])
        try:
            self.info = parse_ready(self._readline())
        except BaseException:
            self.close()
            raise

    def _readline(self):
        return self.proc.stdout.readline()

    def _ask(self, text):
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise ProtocolError(f"the torch process exited; its log: {self._tail()}") from None

    def _tail(self):
        try:
            with open(self.log_path) as f:
                return " | ".join(f.read().strip().splitlines()[-3:])
        except OSError:
            return "(no log)"

    def run_pass(self, method, index):
        self._ask(format_request(method, index))
        try:
            return parse_reply(self._readline(), method, index)
        except ProtocolError as e:
            raise ProtocolError(f"{e}; its log: {self._tail()}") from None

    def save(self, path):
        self._ask(f"save {path}\n")
        line = self._readline()
        _check_error(line)
        if line.strip() != f"saved {path}":
            raise ProtocolError(f"bad reply {line.strip()!r} to 'save {path}'")

    def close(self):
        if self.proc.poll() is None:
            try:
                self._ask("quit\n")
                self.proc.wait(timeout=30)
            except (ProtocolError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _cpu_self():
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class ChildMethod:
    def __init__(self, side, name):
        self.side, self.name = side, name

    def one_pass(self, index):
        # This process's CPU while the child computes: MindSpore's idle thread pool spinning
        # (docs/performance.md) takes cores from the child; reported, not hidden.
        cpu = _cpu_self()
        reply = self.side.run_pass(self.name, index)
        reply["parent_cpu_seconds"] = _cpu_self() - cpu
        return reply

    def close(self):
        pass


class ParentMethod:
    def __init__(self, method):
        self.method = method
        self.want = None

    def one_pass(self, index):
        cpu, t = time.process_time(), time.perf_counter()
        out = self.method.one_pass()
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
        return {"seconds": seconds, "cpu_seconds": cpu, "digest": _digest(out), "output": out}

    def close(self):
        self.method.close()


def _set_ms_threads(threads):
    try:
        from mindspore.device_context.cpu.op_tuning import threads_num
        threads_num(threads)
        return threads
    except Exception as e:  # noqa: BLE001 - reported: the bench still runs at MindSpore's default
        return f"not set: {type(e).__name__}: {e}"


def _interleave(methods, passes):
    order = list(methods)
    log = {name: [] for name in order}
    for r in range(passes + 1):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            log[name].append(methods[name].one_pass(r))
    return log


def _summary(records):
    first, steady = records[0], records[1:]
    return {"first_pass_seconds": first["seconds"],
            "seconds": statistics.median(r["seconds"] for r in steady),
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in steady),
            "passes": [r["seconds"] for r in records],
            **({"parent_cpu_seconds": statistics.median(r["parent_cpu_seconds"] for r in steady)}
               if "parent_cpu_seconds" in first else {})}


def run(directory, args):
    import numpy as np

    from ..backend.framework import mindspore
    from ..config import parse_size
    from .model_methods import Resident, Streamed, build

    python = find_torch_python(getattr(args, "torch_python", None))
    hidden = args.hidden or 4096
    layer_bytes = (hidden * hidden + hidden) * 4
    layers = args.layers or max(4, round(parse_size(args.size, "--size") / layer_bytes))
    model_bytes = layers * layer_bytes
    batch = (args.batch or [8])[0]
    threads = getattr(args, "threads", None) or 2
    budget = int(model_bytes * args.budget)
    passes = max(1, args.repeats)

    ms = mindspore()
    ms.set_device("CPU")
    ms_threads = _set_ms_threads(threads)
    offload_dir = os.path.join(directory, "accelerate-offload")
    os.makedirs(offload_dir, exist_ok=True)
    cfg = {"hidden": hidden, "layers": layers, "batch": batch, "threads": threads, "offload_dir": offload_dir}
    x = ms.Tensor.from_numpy(bench_input(hidden, batch))
    methods = {}
    side = TorchSide(python, cfg, os.path.join(directory, "accelerate-child.log"))
    try:
        for name in CHILD_METHODS:
            methods[name] = ChildMethod(side, name)
        methods["ms_resident"] = ParentMethod(Resident(ms, hidden, layers, x))
        methods["prefetchd"] = ParentMethod(Streamed(
            ms, hidden, layers, x, tier="remote", lookahead=args.lookahead, device_budget=budget,
            host_budget=None, store_dir=os.path.join(directory, "prefetchd-store"), name="bench-accelerate"))
        build(ms, hidden, 1, seed=1)(x).asnumpy()      # MindSpore's one-time costs, untimed
        log = _interleave(methods, passes)
        streamed = methods["prefetchd"].method
        host = streamed.daemon.status()["host"]
        misses = streamed.handle.stats()["misses"]
        saved = os.path.join(directory, "torch-outputs.npz")
        side.save(saved)
        with np.load(saved) as f:
            torch_out = {k: f[k] for k in f.files}
        info = side.info
    finally:
        for m in methods.values():
            m.close()
        side.close()
        for d in (offload_dir, os.path.join(directory, "prefetchd-store")):     # 1 GiB each by default
            shutil.rmtree(d, ignore_errors=True)
    ms_out = log["ms_resident"][0]["output"]
    checks = {
        # Each framework's streamed outputs are its resident model's, bit for bit, every pass.
        "accelerate_matches_torch_resident": len({r["digest"] for n in CHILD_METHODS for r in log[n]}) == 1,
        "prefetchd_matches_ms_resident": len({r["digest"] for n in PARENT_METHODS for r in log[n]}) == 1,
        # Same weights and input on both sides: the two frameworks agree to fp32 rounding.
        "torch_max_abs_diff_vs_mindspore": float(np.max(np.abs(torch_out["torch_resident"] - ms_out))),
    }
    checks["frameworks_agree"] = bool(np.allclose(torch_out["torch_resident"], ms_out, rtol=1e-3, atol=1e-4))
    for records in log.values():
        for r in records:
            r.pop("output", None)
    summary = {name: _summary(log[name]) for name in METHODS}
    seconds = {name: s["seconds"] for name, s in summary.items()}
    r = ratios(seconds)
    ok = (checks["accelerate_matches_torch_resident"] and checks["prefetchd_matches_ms_resident"]
          and checks["frameworks_agree"])
    return {"benchmark": "accelerate", "hidden": hidden, "layers": layers, "batch": batch, "dtype": "float32",
            "model_bytes": model_bytes, "device_budget": budget, "lookahead": args.lookahead, "passes": passes,
            "threads": {"torch": info.get("threads"), "mindspore": ms_threads},
            "page_cache": "warm (never dropped; pass 0 of each method is reported apart)",
            "torch_python": python, "versions": {k: info.get(k) for k in ("torch", "accelerate", "numpy", "python")},
            "accelerate_offload_bytes": info.get("offload_bytes"),
            "prefetchd_host_budget": host["budget"], "prefetchd_misses": misses,
            "seconds": seconds, "ratios": r, "methods": summary, "checks": checks,
            "target_speedup": TARGET_SPEEDUP,
            "target_met": bool(r["accelerate_over_prefetchd"] and r["accelerate_over_prefetchd"] >= TARGET_SPEEDUP),
            # Whether this run's Accelerate leaves room for the target at all: with a
            # prefetchd pass equal to MindSpore's resident one (ratios' ceiling).
            "target_reachable": bool(r["accelerate_over_ms_resident"]
                                     and r["accelerate_over_ms_resident"] >= TARGET_SPEEDUP),
            "ok": ok}


def bench_accelerate(directory, **options):
    """Python entry point: `bench_accelerate(dir, size="4MiB", hidden=256, batch=[4], repeats=1,
    torch_python=...)`; options are the flags of `prefetchd bench accelerate`."""
    from .common import run_from_python
    defaults = dict(hidden=None, layers=None, size="1GiB", budget=0.25, batch=None, repeats=3,
                    lookahead=2, torch_python=None, threads=2)
    return run_from_python(run, directory, defaults, options)
