"""`prefetchd infer`: send .npy inputs to a `prefetchd serve` front, write its outputs.

    prefetchd infer --endpoint ipc://serve.sock --model m0 x.npy [--out DIR]
    prefetchd infer --endpoint ipc://serve.sock --model lm ids.npy --max-new-tokens 16

Each output is written as DIR/output<i>.npy (generate: DIR/tokens.npy) and its
path, dtype and shape printed, one line each. Inputs are read with
allow_pickle=False: an .npy holding Python objects is refused.
"""
import os
import re

from ..telemetry.output_files import output_file_problem, write_atomically
from .common import UsageError, positive_int, seconds

_OUTPUT = re.compile(r"output\d+\.npy|tokens\.npy")     # the names infer writes


def register(sub):
    p = sub.add_parser("infer", help="run .npy inputs through a `prefetchd serve` model")
    p.add_argument("--endpoint", required=True, help="the serve front's endpoint")
    p.add_argument("--model", required=True, help="the model's name (m0, m1, ...)")
    p.add_argument("inputs", nargs="+", help=".npy files, one per model input, in order")
    p.add_argument("--out", default=".", help="directory for the outputs (default: .)")
    p.add_argument("--max-new-tokens", type=positive_int,
                   help="generate this many tokens (a causal LM; one input: the prompt ids)")
    p.add_argument("--timeout", type=seconds, default=60.0, help="seconds to wait (60)")
    p.set_defaults(func=cmd_infer)


def _load(path):
    import numpy as np

    from ..serve.wire import DEFAULT_MAX_TENSOR_BYTES
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic != b"\x93NUMPY":     # else numpy tries a pickle and blames that
            raise ValueError("it does not start as a .npy file does (numpy.save writes one; .npz, text "
                             "and pickles are not read)")
        # Mapped first: a header declaring more than the file holds (1.86 TiB), or more than a
        # request carries (a sparse file as long as its header says), is refused before
        # anything is allocated, not a MemoryError naming no file.
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)
        if mapped.nbytes > DEFAULT_MAX_TENSOR_BYTES:
            raise UsageError(f"infer: {path}: {mapped.nbytes} bytes, above the {DEFAULT_MAX_TENSOR_BYTES >> 20} "
                             f"MiB a request may carry per tensor; send fewer rows")
        return np.array(mapped)
    except ValueError as e:
        if "mmap length is greater than file size" in str(e):
            e = ValueError("its header declares more data than the file holds (truncated?)")
        elif "Python objects" in str(e):
            e = ValueError("it holds Python objects, a pickle, which is never read")
        raise UsageError(f"infer: {path}: not a readable .npy of numbers ({e})") from None
    except OSError as e:
        raise UsageError(f"infer: {path}: not a readable .npy of numbers ({e})") from None


def _check_out_dir(out):
    """--out is a directory or can be made one (it said "[Errno 17] File exists" for a file),
    and no output it could write is there as anything but a file (a FIFO hung the write)."""
    path = os.path.abspath(out)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    if os.path.islink(path) and not os.path.exists(path):
        raise UsageError(f"infer: argument --out: {path} is a symlink to nothing (dangling, or a loop)")
    if os.path.isdir(path) and path == os.path.abspath(out):
        for name in os.listdir(path):
            problem = _OUTPUT.fullmatch(name) and output_file_problem(os.path.join(path, name))
            if problem:
                raise UsageError(f"infer: argument --out: {problem}")
    if not os.path.isdir(path):
        raise UsageError(f"infer: argument --out: {path} is a file, not a directory; --out is the "
                         f"directory the outputs are written to")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"infer: argument --out: {path} is not writable")


def cmd_infer(args):
    import numpy as np

    from ..serve import Client

    arrays = [_load(p) for p in args.inputs]
    if args.max_new_tokens is not None and len(arrays) != 1:
        raise UsageError("infer: --max-new-tokens takes one input, the prompt ids")
    _check_out_dir(args.out)
    from ..control.endpoints import resolve_endpoint
    from .control import _refuse_missing_socket
    _refuse_missing_socket(resolve_endpoint(args.endpoint, "serve"), "serve front",
                           "with this --endpoint")       # at once, not after --timeout
    with Client(args.endpoint, timeout=args.timeout) as c:
        if args.max_new_tokens is not None:
            outputs = {"tokens": c.generate(args.model, arrays[0], args.max_new_tokens)}
        else:
            outputs = {f"output{i}": y for i, y in enumerate(c.infer(args.model, *arrays))}
    os.makedirs(args.out, exist_ok=True)      # once there is something to put there
    for name, y in outputs.items():
        path = os.path.join(args.out, f"{name}.npy")
        write_atomically(path, lambda f, y=y: np.save(f, np.asarray(y)))
        print(f"{path}\t{y.dtype}\t{list(y.shape)}")
    return 0
