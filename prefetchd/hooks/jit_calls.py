"""`mindspore.jit(cell)(x)` on a cell of an offloaded model, outside its forward.

`mindspore.jit(model)` returns the model's construct compiled, bound to the model:
calling it runs the graph without `Cell.__call__`, so none of prefetchd's hooks
run, and the graph read the weights of units not resident, unmapped: SIGSEGV.
`watch` wraps MindSpore's two ways in once:

- ast mode (the default): every call goes through `_JitExecutor.__call__`, with the
  cell as its `obj`, or no obj for a function (`@jit def f(x): return model[0](x)`:
  then the cells the function's code names, as globals or in its closure, count);
- trace mode (`capture_mode="trace"`): the function `_jit_trace` makes, called with
  the cell as its first argument, or a function naming cells as above (the first call
  traces through the cells' own calls; later ones run the graph alone).

For a cell of an offloaded model, the call is refused when no pass of that model
runs on this thread (a @jit block called by the model's forward is the supported
way: its unit is pinned by then) and one of the cell's weights is not resident.
Inside `daemon.use([...])` of all its weights, the same call runs. So is a call of
any other cell holding such weights: an optimizer built over the model's parameters
(its construct is @jit) stepped outside `daemon.use` read them unmapped (SIGSEGV).
"""
import contextlib
import functools
import threading
import types
import weakref

from .. import guard
from ..backend import framework
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
    """Raise PrefetchdError if compiled `cell` would read weights not resident (see above).
    Returns the Offloaded handle whose hooks the call's graph must not compile, or None
    (not a cell of an offloaded model, or called inside its forward)."""
    ref = _watched.get(cell)
    handle = ref() if ref is not None else None
    if handle is not None and handle.turn.held_here():     # (closed: its weights refuse use too)
        return None
    absent = [p.name for p in cell.get_parameters() if guard.is_guarded(p)]
    if absent:
        framework.abandon_grad()          # (refused inside a gradient's forward: see there)
        more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        names = f"{', '.join(map(repr, absent[:3]))}{more}"
        if handle is None:                # another cell holding them: an optimizer over the model's
            raise PrefetchdError(
                f"mindspore.jit over this {type(cell).__name__} runs its graph on weights of an offloaded "
                f"model that are not resident ({names}): run it inside `with daemon.use([...])` of "
                f"those weights")
        raise PrefetchdError(
            f"mindspore.jit over a cell of an offloaded model ({type(cell).__name__}) runs its graph "
            f"without the cell's hooks, and weights it reads are not resident "
            f"({names}): call the model itself (its blocks may be "
            f"@jit-compiled), or run this inside `with daemon.use([...])` of its weights")
    return handle


@contextlib.contextmanager
def hooks_hidden(calls):
    """Run a jit call over cells of offloaded models with prefetchd's hooks out of the hook
    tables of the cells its graph calls. MindSpore 2.10 compiles the forward hooks of those
    cells into the graph, and prefetchd's do not compile ("Unsupported statement 'Import'",
    or a refusal raised at trace time): `mindspore.jit(block)(x)` inside `daemon.use` failed
    whenever the block had sub-cells. The graph runs no hook anyway (the caller made its
    weights resident). `calls`: [(Offloaded handle or None, cell, whether the graph calls
    the cell itself)] (compiled_cells).
    Each model's turn is held meanwhile, and its own pre-hook, which takes the turn, stays
    unless the graph calls the model itself: a forward of it on another thread waits; the
    tables get their hooks back in their order."""
    models = {}                       # id(handle) -> (handle, the cells its graph calls)
    for handle, cell, with_itself in calls:
        if handle is not None:
            models.setdefault(id(handle), (handle, []))[1].extend(compiled_cells(cell, with_itself))
    with contextlib.ExitStack() as stack:
        for handle, cells in models.values():     # each model's turn once: a second held() abandons
            stack.enter_context(handle.turn.held())
            stack.enter_context(_out_of_tables(handle.hook_handles(), cells))
        yield


def _run(calls, fn, *args, **kwargs):
    """fn(*args, **kwargs) within hooks_hidden(calls); straight away when no call is a model's
    to hide hooks of (a @jit block inside its model's forward: every unit's call)."""
    if all(handle is None for handle, _, _ in calls):
        return fn(*args, **kwargs)
    with hooks_hidden(calls):
        return fn(*args, **kwargs)


def compiled_cells(cell, with_itself):
    """The cells a graph compiled of `cell` calls: those under it, and itself when a jit
    function calls it (`mindspore.jit(cell)` runs its construct: its own hooks do not run)."""
    return [c for _, c in cell.cells_and_names()][0 if with_itself else 1:]


@contextlib.contextmanager
def _out_of_tables(hook_handles, cells):
    compiled = {id(table) for c in cells for table in (c._forward_pre_hook, c._forward_hook)}
    tables = {}                       # id(table) -> (table, its items before)
    ours = set()
    for h in hook_handles:
        table = h.hook_dict_ref() if h.hook_dict_ref is not None else None
        if table is not None and id(table) in compiled and h.handle_id in table:
            tables.setdefault(id(table), (table, list(table.items())))
            ours.add(h.handle_id)
    for table, _ in tables.values():
        for key in ours & set(table):
            del table[key]
    try:
        yield
    finally:
        for table, before in tables.values():
            now = dict(table)
            table.clear()
            for key, hook in before:
                if key in ours or key in now:
                    table[key] = now.pop(key, hook)
            table.update(now)         # added meanwhile


def _named_cells(fn):
    """The cells a function's code names as globals or holds in its closure."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found = [fn.__globals__.get(name) for name in code.co_names]
    found += [c.cell_contents for c in fn.__closure__ or () if c.cell_contents is not None]
    return [obj for obj in found if _is_cell(obj)]


def _is_cell(obj):
    """A cell whose graph could read offloaded weights: one of an offloaded model's, or any
    other (an optimizer holds the model's parameters)."""
    return isinstance(obj, framework.mindspore().nn.Cell)


def _check_executor(executor):
    """hooks_hidden's calls: (check_jit_call's handle, cell, with itself) of the executor's
    cell, or of each cell its function names."""
    if executor.obj is not None:
        return [(check_jit_call(executor.obj), executor.obj, False)]
    return [(check_jit_call(cell), cell, True) for cell in _named_cells(executor.fn)]


def _traced(original):
    """mindspore.graph.jit_trace's `_jit_trace`, whose functions check their cell first."""
    def make(jit_config):
        wrap = original(jit_config)

        def wrap_func(fn):
            out = wrap(fn)
            inner = out.__func__ if isinstance(out, types.MethodType) else out
            if not callable(inner):
                return out

            @functools.wraps(inner)
            def call(*args, **kwargs):
                if not _watched:
                    return inner(*args, **kwargs)
                calls = [(check_jit_call(args[0]), args[0], False)] if args and _is_cell(args[0]) else []
                calls += [(check_jit_call(cell), cell, True) for cell in _named_cells(fn)]   # one reaching the model
                return _run(calls, inner, *args, **kwargs)
            return types.MethodType(call, out.__self__) if isinstance(out, types.MethodType) else call
        return wrap_func
    return make


def _install():
    global _installed
    with _install_lock:
        if _installed:
            return
        from mindspore.graph import api
        original = api._JitExecutor.__call__

        def call(self, *args, **kwargs):
            if not _watched:
                return original(self, *args, **kwargs)
            return _run(_check_executor(self), original, self, *args, **kwargs)
        call.__wrapped__ = original
        api._JitExecutor.__call__ = call
        api._jit_trace = _traced(api._jit_trace)
        _installed = True
