"""The few MindSpore calls prefetchd makes, in one place (see docs/mindspore-notes.md).

- `Tensor.from_numpy` is zero-copy, so a framework tensor can view an arena block.
- `Parameter.set_data(t, slice_shape=True)` rebinds storage; it blocks until
  MindSpore's op queue drains if the old storage was used by an op, so callers
  bind on the compute thread, never on the scheduler.
- `hal.synchronize()` is the only fence that works on CPU; it drains every queue
  (`runtime.synchronize()`, its replacement, skips the first call on CPU).
"""
import threading

import numpy as np

from .. import dtypes
from ..guard import base_class

_ms = None

# MindSpore 2.10 does not survive ops dispatched from two threads at once, plain
# or custom, whatever Python lock each holds: its op queue is single-producer, so
# a task is lost (a kernel that never runs, then "The pointer[runtime_info] is
# null" on every synchronize) or corrupt ("The pointer[task] is null", SIGSEGV);
# docs/mindspore-notes.md. Every compute-fence op in the process goes through
# this lock, which keeps prefetchd's own dispatches apart and epochs in queue
# order. It cannot keep them apart from a caller's ops on another thread: build
# and mark a marker where no other thread dispatches meanwhile (the compute thread).
_CUSTOM_OP_LOCK = threading.Lock()


def mindspore():
    global _ms
    if _ms is None:
        import mindspore as ms
        _ms = ms
    return _ms


def is_tensor(x):
    return isinstance(x, mindspore().Tensor)


def is_parameter(x):
    return isinstance(x, mindspore().Parameter)


def to_numpy_dtype(ms_dtype):
    try:
        return dtypes.numpy_dtype(dtypes.name_of(ms_dtype))
    except TypeError:
        raise TypeError(f"dtype {ms_dtype} has no numpy equivalent; prefetchd cannot manage it") from None


def host_copy(x):
    """x's values as numpy, after pending compute that writes x (on CPU a view of x's memory)."""
    return x.asnumpy()


def bind(target, array):
    """Make `target` view `array`'s memory from now on (no copy).

    Calls the framework's own method (not a prefetchd tracking override), so
    rebinding is not mistaken for a user's write.
    """
    share(target, mindspore().Tensor.from_numpy(array))


def share(target, tensor):
    """Make `target` use `tensor`'s storage from now on (writes through either are seen by both)."""
    ms = mindspore()
    wrapper, cls = type(target), base_class(target)
    # The framework's methods call each other through the instance (set_data ->
    # assign_value): take prefetchd's guard/tracking class off while they run.
    target.__class__ = cls
    try:
        if isinstance(target, ms.Parameter):
            cls.set_data(target, tensor, slice_shape=True)
        else:
            cls.assign_value(target, tensor)
    finally:
        target.__class__ = wrapper


def bind_placeholder(target, dtype):
    """Point `target` at a 0-element tensor: later ops on it fail with a shape error."""
    bind(target, np.zeros((0,), dtype=dtype))


_requires_grad = None     # PyNative's requires_grad, looked up once


def recording_grad():
    """True while PyNative records ops for a gradient: in the forward of mindspore.grad,
    value_and_grad, vjp, GradOperation (of a function or a cell), TrainOneStepCell, and of
    a cell after set_grad(True) (checked, MindSpore 2.10). Asked after every unit cell's call."""
    global _requires_grad
    if _requires_grad is None:
        from mindspore.graph.api import _pynative_executor
        _requires_grad = _pynative_executor.requires_grad
    return _requires_grad()


def copy_tensor(tensor):
    """A copy of `tensor` in new memory. While a gradient is recorded, one the gradient flows
    through (ops.deepcopy): Tensor.copy() is not recorded, so a gradient through the copy
    of a weight came back all zeros, unrefused (checked, MindSpore 2.10)."""
    return mindspore().ops.deepcopy(tensor) if recording_grad() else tensor.copy()


def abandon_grad():
    """Reset PyNative's gradient recording, before a refusal raised inside a forward that
    mindspore.grad records: an exception there leaves requires_grad() True for the rest of
    the process (plain MindSpore 2.10), every later op recorded and in-place writes made out
    of place (a tensor sharing another's memory stopped seeing its writes). Checked:
    clear_res() there restores both, and later gradients are right."""
    if recording_grad():
        from mindspore.graph.api import _pynative_executor
        _pynative_executor.clear_res()


def user_forward_hooks(cell):
    """The forward pre-hooks and hooks on `cell` that are not prefetchd's own."""
    def ours(hook):
        function = getattr(hook, "func", hook)          # a functools.partial's
        return (getattr(function, "__module__", None) or "").startswith("prefetchd.")
    # (the lazy dicts read as they are: the properties would give every cell an empty one)
    hooks = [getattr(cell, "_lazy_forward_pre_hook", None), getattr(cell, "_lazy_forward_hook", None)]
    return [h for found in hooks if found for h in found.values() if not ours(h)]


def keep_forward_hook_last(cell, handle):
    """Move the forward hook of `handle` (cell.register_forward_hook's) after every other
    one of `cell`, where one registered since went after it. MindSpore 2.10 keeps a cell's
    forward hooks in an OrderedDict by handle id and runs them in its order (its own
    register_forward_hook(prepend=True) moves one to the front the same way)."""
    hooks = cell._forward_hook
    if hooks and next(reversed(hooks)) != handle.handle_id and handle.handle_id in hooks:
        hooks.move_to_end(handle.handle_id)


def backward_pre_hook(cell_id, hook):
    """A CellBackwardHook primitive whose backward pre-hook is hook(grads): a gradient
    reaching a Tensor the primitive returned runs it before any backward kernel of what
    made that Tensor (grad, value_and_grad, vjp, GradOperation; none runs under
    stop_gradient). What Cell.register_backward_pre_hook builds, without the cell: its
    hook closes over the primitive, which holds the cell, a cycle through C++ that
    Python's gc cannot see (docs/mindspore-notes.md). `hook` here refers to what it
    refers to, nothing more. Called with a tuple of Tensors, it returns a tuple."""
    from collections import OrderedDict
    from mindspore._c_expression import HookType
    from mindspore.ops.operations._inner_ops import CellBackwardHook
    primitive = CellBackwardHook(cell_id, None, OrderedDict())   # (kept by weak reference, unused)
    primitive.set_hook_fn(hook, HookType.BackwardPreHook)
    return primitive


def synchronize():
    # What hal.synchronize calls: on CPU, MindSpore 2.10's runtime.synchronize logs "CPU
    # device is not supported" and returns WITHOUT synchronizing the first time it is
    # called, a fence that does not fence; hal.synchronize itself works, and logs a
    # WARN_DEPRECATED line in the user's process (Daemon.close synchronizes).
    mindspore()
    from mindspore._c_expression import synchronize as synchronize_all
    synchronize_all()


class ComputeMarker:
    """Per-unit compute fences on CPU, from the compute-fence AOT kernel.

    `mark(tensor)` enqueues the kernel behind `tensor`'s producers and returns
    an epoch; once MindSpore has executed every op up to it, the shared word
    reaches that epoch. `reached(e)` reads the word; `wait(e, timeout)` sleeps
    until it gets there (futex, GIL released). This replaces a whole-queue
    `hal.synchronize()` when only an earlier unit's memory is to be reused.

    The kernel counts its runs in the word: marks are queued under one lock,
    numbered as they go, and PyNative launches them from its one op queue in that
    order, so the n-th fence to run is epoch n (a count never exceeds the highest
    epoch run, whatever the order). Each dispatch passes the same two tensors
    and the op's shape is fixed: no Python infer callback and no new input per
    mark (a fresh epoch tensor was most of a ~120 us dispatch; this is ~30 us).
    """

    def __init__(self, block=None):
        """`block`: the 64-byte fence block to count in (native/include/fence_block.h); a
        completion queue's `fence_block` lets `CompletionQueue.watch_fence` wake its wait()
        when a fence runs. A fresh one by default (wait() and reached() only)."""
        import os
        from .. import _native
        ms = mindspore()
        lib = _kernel_path()
        # MindSpore checks an AOT library against MS_CUSTOM_AOT_WHITE_LIST, one directory, each
        # time it builds the kernel for a new shape; unset, it allows any path. Setting it here
        # would refuse the user's own AOT kernels elsewhere: it is only read, never written.
        allowed = os.environ.get("MS_CUSTOM_AOT_WHITE_LIST")
        if allowed is not None:
            legal = os.path.realpath(allowed)
            if os.path.commonpath([os.path.realpath(lib), legal]) != legal:
                raise RuntimeError(
                    f"MS_CUSTOM_AOT_WHITE_LIST={allowed!r} does not contain prefetchd's compute-fence "
                    f"kernel {lib}; set it to a directory holding both it and your own kernels")
        self._native = _native
        self._word_block = _native.aligned_buffer(64) if block is None else block
        # The kernel is handed the whole block (int64[8]): it counts in word 0 and reads
        # word 1 (the epoch a waiter asked to be woken at); the tensor views it, no copy.
        words = np.frombuffer(self._word_block, np.int64, 8)
        if words[0]:
            raise ValueError("ComputeMarker: the fence block has counted fences already (one marker per block)")
        self.word = words[:1]
        self._word_tensor = ms.Tensor.from_numpy(words)
        with _CUSTOM_OP_LOCK:
            self._op = ms.ops.Custom(f"{lib}:ComputeFence", out_shape=(1,), out_dtype=ms.int64,
                                     func_type="aot")
        self._epoch = 0
        # Prove the path end to end once, so a broken kernel is found here, not mid-run.
        probe = self.mark(ms.Tensor(np.zeros(1, np.float32)))
        if self.wait(probe, 10.0) < probe:
            raise RuntimeError("compute-fence kernel did not run")

    def mark(self, tensor):
        """Queue the fence behind `tensor` (an op dispatch: on the thread that runs compute, or
        with no other thread dispatching; marks from several threads are ordered by epoch)."""
        with _CUSTOM_OP_LOCK:
            # Numbered only once queued: a dispatch that raises queued nothing, and the
            # count in the word must keep matching the numbers handed out.
            self._op(tensor, self._word_tensor)
            self._epoch += 1
            return self._epoch

    def reached(self, epoch):
        return int(self.word[0]) >= epoch

    def wait(self, epoch, timeout):
        return self._native.wait_word(self._word_block, epoch, timeout)


def _kernel_path():
    import glob
    import os
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(here, "_compute_fence*.so")))
    if not found:
        raise FileNotFoundError(f"compute-fence kernel not built (no _compute_fence*.so in {here})")
    return found[0]


def invalidate_compiled(cell):
    """Forget the graphs MindSpore compiled for `cell` (its @jit methods, graph-mode calls).

    A compiled graph keeps the parameter storage it saw at compile time; after
    prefetchd rebinds the parameters it would silently compute with the old
    values. Dropping the cell's phases makes the next call recompile against
    the storage the parameters hold then. Returns how many phases were dropped.

    Private MindSpore 2.10 API: jit phases live in the set
    `mindspore.graph.api.ms_compile_cache`, named with `.{id(cell)}.`; their
    resources are released like `Cell.__del__` does (the graph executor's
    `del_net_res`). If that API is gone and the cell has compiled phases,
    raises RuntimeError: a stale graph must be refused, never run.
    """
    try:
        from mindspore.graph import api
        from mindspore._c_expression import JitExecutor_
        cache, executor = api.ms_compile_cache, api._cell_graph_executor
    except (ImportError, AttributeError):
        if getattr(cell, "phase_cache", None) or getattr(cell, "_compile_cache", None):
            raise RuntimeError("this MindSpore keeps compiled graphs where prefetchd cannot drop them "
                               "(mindspore.graph.api.ms_compile_cache is gone); offload the model "
                               "before its first compiled call") from None
        return 0
    marker = f".{id(cell)}."
    phases = {phase for phase in cache if marker in phase}
    own = set(getattr(cell, "_compile_cache", None) or ())   # graph-mode compiles of this cell
    if phases:
        executor.del_net_res(cell, phases)
        JitExecutor_.get_instance().del_net_res(cell, phases)
        cache.difference_update(phases)
    if own:
        executor.del_net_res(cell, own)
        cell._compile_cache.clear()
    phase_cache = getattr(cell, "phase_cache", None)
    if phase_cache:
        for key in [k for k, v in phase_cache.items() if v in phases or v in own]:
            del phase_cache[key]
    return len(phases | own)
