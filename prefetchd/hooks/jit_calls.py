"""`mindspore.jit(cell)(x)` on a cell of an offloaded model, outside its forward.

`mindspore.jit(model)` returns the model's construct compiled, bound to the model:
calling it runs the graph without `Cell.__call__`, so none of prefetchd's hooks
run, and the graph read the weights of units not resident, unmapped: SIGSEGV.
Every jit call goes through MindSpore's `_JitExecutor.__call__` with the cell as
its `obj`; `watch` wraps that once, and for a cell of an offloaded model it
refuses the call when no pass of that model runs on this thread (a @jit block
called by the model's forward is the supported way: its unit is pinned by then)
and one of the cell's weights is not resident. Inside `daemon.use([...])` of all
its weights, the same call runs.
"""
import threading
import weakref

from .. import guard
from ..errors import PrefetchdError

# cell of an offloaded model -> a weak reference to its Offloaded handle (a strong one would
# keep the cell, its key, alive through handle.model: the model was never collected)
_watched = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()
_installed = False


def watch(model, handle):
    """Refuse jit calls on `model`'s cells outside its passes while weights are not resident."""
    _install()
    ref = weakref.ref(handle)
    for _, cell in model.cells_and_names():
        _watched[cell] = ref


def check_jit_call(cell):
    """Raise PrefetchdError if compiled `cell` would read weights not resident (see above)."""
    ref = _watched.get(cell)
    handle = ref() if ref is not None else None
    if handle is None or handle.turn.held_here():     # (closed: its weights refuse use too)
        return
    absent = [p.name for p in cell.get_parameters() if guard.is_guarded(p)]
    if absent:
        more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        raise PrefetchdError(
            f"mindspore.jit over a cell of an offloaded model ({type(cell).__name__}) runs its graph "
            f"without the cell's hooks, and weights it reads are not resident "
            f"({', '.join(map(repr, absent[:3]))}{more}): call the model itself (its blocks may be "
            f"@jit-compiled), or run this inside `with daemon.use([...])` of its weights")


def _install():
    global _installed
    with _install_lock:
        if _installed:
            return
        from mindspore.graph import api
        original = api._JitExecutor.__call__

        def call(self, *args, **kwargs):
            if self.obj is not None and _watched:
                check_jit_call(self.obj)
            return original(self, *args, **kwargs)
        call.__wrapped__ = original
        api._JitExecutor.__call__ = call
        _installed = True
