"""The torch side of `prefetchd bench accelerate` (see accelerate.py): the line protocol both
sides speak, the shared weights and input, and the child process that runs PyTorch.

This file is the child's script: run by the torch interpreter, it imports nothing from
prefetchd (that interpreter need not have it installed).
"""
import hashlib
import json
import os
import sys
import time

CHILD_METHODS = ("torch_resident", "accelerate")
PARENT_METHODS = ("ms_resident", "prefetchd")
METHODS = CHILD_METHODS + PARENT_METHODS
TORCH_PYTHON_ENV = "PREFETCHD_TORCH_PYTHON"
TARGET_SPEEDUP = 5.0     # issue #27: with page moves instead of copies (was 3.0, issue #11)


class ProtocolError(RuntimeError):
    """The child said something the protocol does not allow (or died)."""


class SetupError(RuntimeError):
    """No interpreter with torch and accelerate: one line saying how to give one."""


# -- the line protocol (pure; unit-tested without torch) ---------------------------------------

def format_request(method, index):
    if method not in CHILD_METHODS:
        raise ValueError(f"unknown child method {method!r}; known: {', '.join(CHILD_METHODS)}")
    return f"pass {method} {int(index)}\n"


def parse_request(line):
    """('pass', method, i) | ('save', path) | ('quit',); ProtocolError otherwise."""
    words = line.strip().split(" ", 1)
    verb = words[0]
    if verb == "pass":
        parts = line.split()
        if len(parts) != 3 or parts[1] not in CHILD_METHODS or not parts[2].isdigit():
            raise ProtocolError(f"bad request {line.strip()!r}: want 'pass METHOD I'")
        return ("pass", parts[1], int(parts[2]))
    if verb == "save" and len(words) == 2 and words[1].strip():
        return ("save", words[1].strip())
    if verb == "quit" and len(words) == 1:
        return ("quit",)
    raise ProtocolError(f"bad request {line.strip()!r}: want 'pass METHOD I', 'save PATH' or 'quit'")


def format_reply(method, index, seconds, cpu_seconds, digest):
    return f"done {method} {int(index)} {seconds!r} {cpu_seconds!r} {digest}\n"


def _check_error(line):
    if line == "":
        raise ProtocolError("the torch process exited (end of its output)")
    if line.startswith("error "):
        raise ProtocolError(f"the torch process failed: {line[6:].strip()}")


def parse_reply(line, method, index):
    """The child's answer to `pass METHOD I` -> {seconds, cpu_seconds, digest}."""
    _check_error(line)
    parts = line.split()
    if len(parts) != 6 or parts[0] != "done":
        raise ProtocolError(f"bad reply {line.strip()!r}: want 'done METHOD I SECONDS CPU_SECONDS DIGEST'")
    if parts[1] != method or parts[2] != str(int(index)):
        raise ProtocolError(f"reply {line.strip()!r} answers another request than 'pass {method} {index}'")
    try:
        seconds, cpu = float(parts[3]), float(parts[4])
    except ValueError:
        raise ProtocolError(f"bad reply {line.strip()!r}: seconds are not numbers") from None
    if not seconds > 0 or cpu < 0:
        raise ProtocolError(f"bad reply {line.strip()!r}: seconds must be > 0 and cpu seconds >= 0")
    return {"seconds": seconds, "cpu_seconds": cpu, "digest": parts[5]}


def parse_ready(line):
    _check_error(line)
    if not line.startswith("ready "):
        raise ProtocolError(f"bad greeting {line.strip()!r}: want 'ready {{json}}'")
    try:
        info = json.loads(line[6:])
    except json.JSONDecodeError as e:
        raise ProtocolError(f"bad greeting {line.strip()!r}: {e}") from None
    if not isinstance(info, dict):
        raise ProtocolError(f"bad greeting {line.strip()!r}: not a JSON object")
    return info


def ratios(seconds):
    """Ratios of median pass times (seconds by method): above 1 means the numerator is slower."""
    def div(a, b):
        return seconds[a] / seconds[b] if seconds.get(a) and seconds.get(b) else None
    out = {
        "accelerate_over_prefetchd": div("accelerate", "prefetchd"),
        "accelerate_over_torch_resident": div("accelerate", "torch_resident"),
        "prefetchd_over_ms_resident": div("prefetchd", "ms_resident"),
        "torch_resident_over_ms_resident": div("torch_resident", "ms_resident"),
        # The ceiling of accelerate_over_prefetchd: what it would be if prefetchd cost
        # nothing over MindSpore's resident pass (a streamed pass is not faster than that).
        "accelerate_over_ms_resident": div("accelerate", "ms_resident"),
    }
    # The offload cost alone: pass time above each framework's own resident pass.
    over = {name: seconds[name] - seconds[base] for name, base in (("accelerate", "torch_resident"),
                                                                    ("prefetchd", "ms_resident"))
            if seconds.get(name) is not None and seconds.get(base) is not None}
    out["accelerate_overhead_seconds"] = over.get("accelerate")
    out["prefetchd_overhead_seconds"] = over.get("prefetchd")
    return out


# -- the child (runs under the torch interpreter; numpy, torch, accelerate only) ---------------

def weights(hidden, layers, seed=0):
    """[(weight, bias)] per layer, the values prefetchd.bench.model_methods.build gives."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        w = rng.standard_normal((hidden, hidden), dtype=np.float32) * (1.0 / np.sqrt(hidden))
        b = rng.standard_normal((hidden,), dtype=np.float32) * 0.01
        out.append((w.astype(np.float32, copy=False), b.astype(np.float32, copy=False)))
    return out


def bench_input(hidden, batch):
    import numpy as np
    return np.random.default_rng(batch).standard_normal((batch, hidden), dtype=np.float32)


def _digest(array):
    return hashlib.sha1(array.tobytes()).hexdigest()[:16]


def _torch_models(cfg):
    import torch
    from accelerate.big_modeling import disk_offload

    def stack():
        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(cfg["hidden"], cfg["hidden"])
                                          for _ in range(cfg["layers"])])
        return model.to_empty(device="cpu")

    resident, offloaded = stack(), stack()
    with torch.no_grad():
        for i, (w, b) in enumerate(weights(cfg["hidden"], cfg["layers"])):
            for model in (resident, offloaded):
                model[i].weight.copy_(torch.from_numpy(w))
                model[i].bias.copy_(torch.from_numpy(b))
    resident.eval()
    offloaded.eval()
    # Writes every weight to offload_dir as a memmapped .dat file (+ index.json); the model's
    # parameters become meta tensors, and hooks load each module's weights when it runs.
    disk_offload(offloaded, cfg["offload_dir"], execution_device=torch.device("cpu"))
    in_ram = [p for p in offloaded.parameters() if p.device.type != "meta"]
    if in_ram:
        raise RuntimeError(f"disk_offload left {len(in_ram)} parameters in RAM")
    return {"torch_resident": resident, "accelerate": offloaded}


def _child(cfg):
    proto = os.fdopen(os.dup(1), "w", buffering=1)      # the protocol's own stdout...
    os.dup2(2, 1)                                        # ...anything else printed goes to stderr
    sys.stdout = sys.stderr

    def say(text):
        proto.write(text if text.endswith("\n") else text + "\n")
        proto.flush()

    try:
        import numpy as np
        import accelerate
        import torch
        torch.set_num_threads(cfg["threads"])
        models = _torch_models(cfg)
        x = torch.from_numpy(bench_input(cfg["hidden"], cfg["batch"]))
        offload_bytes = sum(os.path.getsize(os.path.join(cfg["offload_dir"], f))
                            for f in os.listdir(cfg["offload_dir"]) if f.endswith(".dat"))
        say("ready " + json.dumps({"torch": torch.__version__, "accelerate": accelerate.__version__,
                                   "numpy": np.__version__, "python": sys.version.split()[0],
                                   "threads": torch.get_num_threads(), "offload_bytes": offload_bytes,
                                   "pid": os.getpid()}))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        say(f"error {type(e).__name__}: {e}".replace("\n", " "))
        return 1
    last = {}
    for line in sys.stdin:
        try:
            request = parse_request(line)
            if request[0] == "quit":
                say("bye")
                return 0
            if request[0] == "save":
                np.savez(request[1], **last)
                say(f"saved {request[1]}")
                continue
            _, method, index = request
            with torch.no_grad():
                cpu, t = time.process_time(), time.perf_counter()
                out = models[method](x)
                seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
            last[method] = out.numpy()
            say(format_reply(method, index, seconds, cpu, _digest(last[method])))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
            say(f"error {type(e).__name__}: {e}".replace("\n", " "))
            return 1
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    # Run as a script, this file's folder is first on sys.path and this file would shadow the
    # real `accelerate` package: drop it before anything imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(_child(json.loads(sys.argv[2])))
