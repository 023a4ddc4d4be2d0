"""Parameters a cell's construct reads directly, not through a sub-cell's call.

    direct_reads(block) -> [("self.fc2.weight", Parameter), ...]

A unit pins its parameters only while its own cells run (their forward hooks).
A construct that reads a descendant's Parameter without calling that
descendant — a block doing `ops.matmul(y, self.fc2.weight)`, a model reading
its tied embedding `self.transformer.wte.embedding_table` — reads it outside
that descendant's call, where nothing pinned it: the page is unmapped and the
kernel dies. The planner (prefetchd/hooks/planner.py) keeps such a block whole,
or pins the parameter in the root unit.

Found from the construct's source (prefetchd/analysis/source_chains.py gives
the chains of steps from `self`), resolved here against the live cells:
- attribute chains and constant indexes through sub-cells that reach a
  Parameter (`self.fc2.weight`, `self.blocks[0].fc1.weight`), names bound to
  sub-cells by loops, assignment or `getattr(self, name)`;
- metadata reads no bytes and does not count: `.shape`, `.dtype`,
  `.is_floating_point()`, `.numel()`, ... (METADATA), and so neither does a
  property or helper built only on it (HF/mindone's `PreTrainedModel.dtype`
  loops over `self.get_parameters()` reading `p.dtype`);
- a method called on `self` or on a sub-cell (`self.embed(x)` with a helper
  `embed`, `self.attn.project(y)`, an explicit `self.attn.construct(y)`) or a
  property runs without that cell's hooks: its body is read as part of the
  construct, with its `self` standing for that cell;
- a sub-cell (or `self`) handed to a plain Python function, a method of a
  plain object or a callable attribute (`_chunked_feed_forward(self.ff, x)`,
  `self.processor(self, x)`) is followed into that callee's source with the
  argument bound: a callee that only calls the cell is a call (its hooks fire), and
  so is `mindspore.recompute(cell, ...)`;
- a plain callable attribute the construct calls (`self.post(x)` with a
  functools.partial or a lambda over a block, a callable object) counts as reading
  every cell and parameter it holds (bound arguments, closure, defaults, its own
  attributes): a lambda has no source of its own to follow;
- where the analysis cannot see — a callee without source, a MindSpore
  function given a cell, `*args`, deeper than MAX_INLINE — the cell counts as
  reading all of its parameters (safe: pinned, never read unmapped).
A construct without source (built at run time) reports nothing.

"""
import builtins
import collections.abc
import functools
import inspect
import types

from ..analysis.chain_steps import (ANY_ATTR, ANY_ITEM, CALL, FORMATTED, LISTED, OPAQUE, PARAMS, RETURNED, SLICED,
                                    SUPER, is_passed)
from ..analysis.source_chains import chains
from ..backend import framework

# Attributes and methods of a Parameter that read no bytes from its storage.
METADATA = frozenset({"shape", "dtype", "ndim", "name", "itemsize", "nbytes", "requires_grad", "size",
                      "strides", "is_init", "param_info", "is_floating_point", "numel", "nelement", "dim",
                      "ndimension", "is_complex", "element_size", "has_init", "data_type"})
MAX_INLINE = 4       # depth of methods and helpers read as part of a construct


def direct_reads(cell):
    """(expression, Parameter) for each Parameter `cell`'s construct, or a forward (pre-)hook
    a user registered on it, may read without a call of the sub-cell that owns it."""
    found, seen = {}, set()
    _collect(cell, type(cell).construct, None, (), found, depth=0, seen=seen)
    for hook in framework.user_forward_hooks(cell):
        _hook_reads(cell, hook, found, seen)
    return list(found.values())


def _hook_reads(cell, hook, found, seen):
    """A forward hook or pre-hook on `cell` (weight-norm logging, an observer) runs outside
    the calls of its sub-cells: what it reads from its first argument (the cell), and from
    `self` for a cell's method, is read there (a plain object's `self` is not followed). One
    whose source cannot be read (a lambda) counts what it holds (_held_read)."""
    function, arg = hook, None
    if inspect.ismethod(hook):             # hook(cell, ...) bound to an object: its 2nd argument
        function = hook.__func__
        names = list(inspect.signature(function).parameters)
        arg = names[1] if len(names) > 1 else None
    inner = {}
    if not (inspect.isfunction(function) and (arg or not inspect.ismethod(hook))
            and _collect(cell, function, arg, (), inner, depth=1, seen=seen)):
        _held_read(f"its forward hook {getattr(hook, '__qualname__', type(hook).__name__)}", hook, found)
        return
    owner = getattr(hook, "__self__", None)
    if isinstance(owner, framework.mindspore().nn.Cell):    # a cell's method: its `self` too
        _collect(owner, function, None, (), inner, depth=1, seen=seen)
    where = f" (in its forward hook {function.__qualname__.rsplit('<locals>.', 1)[-1]})"
    for pid, (expr, p) in inner.items():
        found.setdefault(pid, (expr + where, p))


def _collect(root, function, arg, prefix, found, depth, seen, result_called=False):
    """Resolve the chains of `function` from its argument `arg` (None: the first) bound to
    `root`, each prefixed with `prefix`. result_called: the caller calls what `function`
    returns (a cell returned is then a call, its hooks fire). False if its source cannot be read."""
    key = (function, id(root), arg, prefix, result_called)
    if key in seen:
        return True
    seen.add(key)
    steps = chains(function, arg)
    if steps is None:
        inner = _wrapped(function) if arg is None else None
        return inner is not None and _collect(root, inner, arg, prefix, found, depth, seen, result_called)
    for chain in steps:
        for expr, obj, rest in resolve(root, prefix + chain, function):
            _note(root, function, expr, obj, rest, found, depth, seen, result_called)
    return True


def _note(root, function, expr, obj, rest, found, depth, seen, result_called=False):
    ms = framework.mindspore()
    if rest and rest[0] == RETURNED and result_called and isinstance(obj, ms.nn.Cell):
        return                                       # the caller calls it: its hooks fire
    if isinstance(obj, ms.Parameter):
        if not (rest and rest[0] in METADATA | {CALL}):
            found.setdefault(id(obj), (expr, obj))
    elif isinstance(obj, ms.nn.Cell):
        if rest and rest[0] == FORMATTED:
            return                                   # its repr names its class, reads no weight
        if rest and is_passed(rest[0]):
            _follow_passed(root, function, expr, obj, rest[0], found, depth, seen)
        elif not rest or rest[0] in (OPAQUE, RETURNED):   # not called: what reads it is not known
            _all_read(obj, f"{expr} (used other than called)", found)
    elif rest and rest[0] == CALL and inspect.ismethod(obj) and isinstance(obj.__self__, ms.nn.Cell):
        # A method of a cell called directly: its hooks do not run, so its body reads as ours.
        owner, method = obj.__self__, obj.__func__
        if is_framework(method):
            return
        base = expr[:-len(obj.__name__) - 1]     # the owner's expression: "self.attn" of "self.attn.project"
        if depth >= MAX_INLINE:
            _all_read(owner, f"{expr}() (not followed deeper)", found)
            return
        # `self.get_input_embeddings()(ids)`: what the method returns is called (or returned
        # by a method whose result is called)
        then = rest[1:2]
        called = then == (CALL,) or (then == (RETURNED,) and result_called)
        inner = {}
        if not _collect(owner, method, None, (), inner, depth + 1, seen, called):
            _all_read(owner, f"{expr}() (its source cannot be read)", found)
        for pid, (e, p) in inner.items():
            found.setdefault(pid, (base + e[len("self"):], p))
    elif rest and rest[0] == CALL and callable(obj) and not _is_framework_object(obj):
        _held_read(expr, obj, found)


def _held_read(expr, obj, found):
    """A plain callable (a functools.partial, a lambda or function, a callable object) called
    from the construct: the cells and parameters it holds (bound arguments, closure,
    defaults, its object's attributes) run or are read inside it, where the analysis does not
    follow (a lambda has no source of its own): all their parameters count as read."""
    ms = framework.mindspore()
    held, todo, seen = [], [obj], set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (ms.Parameter, ms.nn.Cell)):
            held.append(item)
        elif isinstance(item, functools.partial):
            todo += [item.func, *item.args, *item.keywords.values()]
        elif inspect.ismethod(item):
            todo += [item.__self__, item.__func__]
            if hasattr(item.__self__, "__dict__"):          # a plain object's method: its attributes
                todo += list(vars(item.__self__).values())
        elif inspect.isfunction(item):
            todo += [c.cell_contents for c in item.__closure__ or () if _filled(c)]
            todo += [*(item.__defaults__ or ()), *(item.__kwdefaults__ or {}).values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo += list(item)
        elif isinstance(item, dict):
            todo += list(item.values())
        elif item is obj and hasattr(item, "__dict__"):      # a callable object: its own attributes
            todo += list(vars(item).values())
    for thing in held:
        why = f"{expr}() (a callable holding it)"
        if isinstance(thing, ms.Parameter):
            found.setdefault(id(thing), (why, thing))
        else:
            _all_read(thing, why, found)


def _filled(cell):
    try:
        cell.cell_contents
    except ValueError:                  # an empty closure cell
        return False
    return True


def _all_read(cell, why, found):
    for p in cell.get_parameters():
        found.setdefault(id(p), (why, p))


def _follow_passed(root, function, expr, cell, step, found, depth, seen):
    """`cell` (written `expr`) handed to a callee in `function`: follow the callee's source with
    that argument bound to `cell`, or count all its parameters read where it cannot be followed."""
    _, callee, slot = step
    if slot == 0 and _calls_its_cell(_callee_object(root, function, callee)):
        return                                       # the cell's own call: its hooks fire
    # Every function the callee may be (a local alias of several, a mapping's values), each
    # followed; where one cannot be, all of the cell counts as read.
    targets = [_function_of(obj) for obj in _callee_objects(root, function, callee)]
    args = [None if t is None else _argument(t[0], slot, t[1]) for t in targets]
    name = _callee_name(callee)
    if not args or None in args or depth >= MAX_INLINE:
        _all_read(cell, f"{expr} (passed to {name}, not followed)", found)
        return
    for target, arg in zip(targets, args):
        inner = {}
        if not _collect(cell, target[0], arg, (), inner, depth + 1, seen):
            _all_read(cell, f"{expr} (passed to {name}, whose source cannot be read)", found)
        for pid, (e, p) in inner.items():
            found.setdefault(pid, (f"{expr}{e[len('self'):]} (in {name}, given {expr})", p))


def _callee_name(callee):
    kind, ref = callee
    if kind in ("any", "values"):
        return f"{ref[0]}()" if kind == "any" else _callee_name(ref).replace("()", "[...]()")
    if kind == "name":
        return f"{ref}()"
    if kind == "dotted":
        return ".".join(ref) + "()"
    return "self" + "".join(f".{s}" if isinstance(s, str) else f"[{s}]" for s in ref) + "()"


def _calls_its_cell(obj):
    """A MindSpore function that runs the cell it is given as a call of that cell, hooks
    and all (checked on 2.10: `mindspore.recompute(block, x)`, which HF-style models use
    in a training-only branch, fires block's forward hooks)."""
    return obj is not None and obj is getattr(framework.mindspore(), "recompute", None)


def _callee_object(root, function, callee):
    """What a callee names: the object, or None where it cannot be told."""
    ms = framework.mindspore()
    kind, ref = callee
    function = inspect.unwrap(function)
    if kind in ("any", "values"):
        return None                                  # several: _callee_objects
    if kind == "self":
        found = [obj for _, obj, _ in resolve(root, ref + (CALL,), function)]
        return found[0] if len(found) == 1 else None
    names = (ref,) if kind == "name" else ref
    obj = _free_variable(function, names[0])
    for attr in names[1:]:
        obj = getattr(obj, attr, None) if obj is not None and not isinstance(obj, ms.nn.Cell) else None
    return obj


def _callee_objects(root, function, callee):
    """Every object a callee may be: one, or those of a local alias's callees and every value
    of a mapping (`ALL_ATTENTION_FUNCTIONS[impl]`); None for one that cannot be told."""
    kind, ref = callee
    if kind == "any":
        return [obj for alternative in ref[1] for obj in _callee_objects(root, function, alternative)]
    if kind == "values":
        table = _callee_object(root, function, ref)
        return (list(table.values()) or [None]) if isinstance(table, collections.abc.Mapping) else [None]
    return [_callee_object(root, function, callee)]


def _function_of(obj):
    """(plain Python function, arguments bound before the first written one) for a callee, or
    None: a builtin, a MindSpore function or class, anything that is not plain source."""
    ms = framework.mindspore()
    if obj is None or isinstance(obj, (type, ms.nn.Cell)):
        return None
    if inspect.isfunction(obj):
        bound = 0
    elif inspect.ismethod(obj):
        obj, bound = obj.__func__, 1
    elif inspect.isfunction(getattr(type(obj), "__call__", None)):
        obj, bound = type(obj).__call__, 1            # a callable object: an attention processor
    else:
        return None
    obj = inspect.unwrap(obj)
    return None if is_framework(obj) else (obj, bound)


def _wrapped(function):
    """The one function a decorator's wrapper closes over (`def wrapper(*args, **kwargs):
    return f(*args, **kwargs)` without functools.wraps: its own source names no argument),
    or None."""
    inner = [c.cell_contents for c in getattr(function, "__closure__", None) or ()
             if _filled(c) and inspect.isfunction(c.cell_contents)]
    return inner[0] if len(inner) == 1 else None


def _free_variable(function, name):
    """What `name` means inside `function`: a closure cell, a global, a builtin; None if unknown."""
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None) or ()
    if code is not None and name in code.co_freevars:
        try:
            return closure[code.co_freevars.index(name)].cell_contents
        except (IndexError, ValueError):
            return None
    scope = getattr(function, "__globals__", {})
    if name in scope:
        return scope[name]
    return getattr(builtins, name, None)


def _argument(function, slot, bound):
    """The name of the parameter of `function` that receives argument `slot` (a position after
    `bound` bound ones, or a keyword); None if it lands in *args / **kwargs or nowhere."""
    code = function.__code__
    positional = code.co_varnames[:code.co_argcount]
    if isinstance(slot, int):
        index = slot + bound
        return positional[index] if index < len(positional) else None
    keywords = code.co_varnames[code.co_posonlyargcount:code.co_argcount + code.co_kwonlyargcount]
    return slot if slot in keywords else None


def _is_framework_object(obj):
    """A callable MindSpore defines (an op, a Primitive, a function): it holds no weight."""
    defined = obj if inspect.isfunction(obj) or inspect.ismethod(obj) else type(obj)
    return is_framework(defined)


def is_framework(function):
    """Methods MindSpore itself defines (Cell's own API): they read no weights of the model."""
    function = inspect.unwrap(function)          # a @jit method: its wrapper is MindSpore's, not it
    module = getattr(function, "__module__", "") or ""
    return module.startswith("mindspore.")


def _member(cell, name):
    """A cell's Parameter, sub-cell or plain attribute `name`, without calling anything
    (no truth test either: a Parameter's truth value is an error for more than one element)."""
    for table in (cell.__dict__.get("_params", {}), cell.__dict__.get("_cells", {}), cell.__dict__):
        if name in table:
            return table[name]
    return None


def _items(obj):
    ms = framework.mindspore()
    if isinstance(obj, (ms.nn.CellList, ms.nn.SequentialCell)):
        return [(f"[{i}]", c) for i, c in enumerate(obj)]
    if isinstance(obj, ms.nn.CellDict):
        return [(f"[{k!r}]", c) for k, c in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", c) for i, c in enumerate(obj)]
    if isinstance(obj, dict):                           # a cell's own tables (_cells, _params)
        return [(f"[{k!r}]", c) for k, c in obj.items()]
    if isinstance(obj, ms.ParameterTuple):
        return [(f"[{i}]", p) for i, p in enumerate(obj)]
    return []


def _attributes(cell):
    return [(f".{k}", v) for table in ("_params", "_cells") for k, v in cell.__dict__.get(table, {}).items()
            if v is not None]


def resolve(root, chain, function=None):
    """Follow `chain` from `root`: (expression, object reached, the steps after it) for each
    object a Parameter, a cell used as the chain says, or a method called. `function`: the
    one whose chains they are (a super() in it is resolved from its class)."""
    ms = framework.mindspore()
    out = []

    def follow(obj, expr, i):
        if isinstance(obj, ms.Parameter) or i == len(chain) or chain[i] in (CALL, OPAQUE, FORMATTED, RETURNED) \
                or is_passed(chain[i]):
            out.append((expr, obj, chain[i:]))
            return
        step = chain[i]
        if step == PARAMS:
            if isinstance(obj, ms.nn.Cell):           # each of its parameters, then the rest
                params = _unique(obj.get_parameters())
                key = chain[i + 1] if i + 1 < len(chain) else None
                # parameters_dict()["blocks.1.fc.weight"]: that one parameter, not all of them
                named = [p for p in params if isinstance(key, str) and p.name == key]
                skip = 2 if named or key == ANY_ITEM else 1
                for p in named or params:
                    follow(p, f"{expr}.get_parameters()[{p.name!r}]", i + skip)
        elif step == SUPER:              # super(): the class after the method's own, for root
            cls = _free_variable(inspect.unwrap(function), "__class__") if function is not None else None
            if isinstance(cls, type) and isinstance(obj, cls):
                follow(super(cls, obj), expr, i + 1)   # (its weights are self.<path> all the same)
            else:                        # not known: everything under it
                out.append((expr, obj, (OPAQUE,)))
        elif isinstance(obj, super):     # super().method: the parent's, bound to root
            member = getattr(obj, step, None) if isinstance(step, str) else None
            if member is not None:
                follow(member, f"{expr}.{step}", i + 1)
        elif step == LISTED:             # a list of it, used other than by its items: not followed
            out.append((f"{expr} (in a list the construct builds)", obj, (OPAQUE,)))
        elif step == SLICED:             # a slice of a container used as one: the container
            follow(obj, f"{expr}[...]", i + 1)
        elif step == ANY_ITEM:
            for label, item in _items(obj):
                follow(item, expr + label, i + 1)
        elif step == ANY_ATTR:           # named as what the getattr may return, not as a read of ours
            if isinstance(obj, ms.nn.Cell):
                for label, item in _attributes(obj):
                    follow(item, f"getattr({expr}, <a computed name>) as {expr}{label}", i + 1)
        elif isinstance(step, str) and isinstance(obj, dict):
            if step in obj:
                follow(obj[step], f"{expr}[{step!r}]", i + 1)
        elif isinstance(step, int):
            try:
                item = obj[step] if isinstance(obj, (ms.nn.CellList, ms.nn.SequentialCell, list, tuple,
                                                     ms.ParameterTuple)) else None
            except IndexError:
                item = None
            if item is not None:
                follow(item, f"{expr}[{step}]", i + 1)
        elif isinstance(obj, ms.nn.Cell):
            member = _member(obj, step)
            prop = getattr(type(obj), step, None)
            if member is None and isinstance(prop, property) and prop.fget is not None:
                # A property's body runs here, without the cell's hooks: read like a method
                # (never evaluated: it may compute on weights that are not resident).
                out.append((f"{expr}.{prop.fget.__name__}", types.MethodType(prop.fget, obj), (CALL,)))
                return
            if member is None and i + 1 < len(chain) and chain[i + 1] == CALL:
                member = getattr(obj, step, None)       # a method, called: followed into
            if member is not None:
                follow(member, f"{expr}.{step}", i + 1)

    follow(root, "self", 0)
    return out


def _unique(params):
    return list({id(p): p for p in params}.values())


def is_jit(function):
    """True if `function` is wrapped by mindspore.jit (MindSpore marks the wrapper)."""
    return bool(getattr(function, "__wrapped_by_jit__", False))
