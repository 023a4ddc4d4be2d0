"""Parameters a cell's construct reads directly, not through a sub-cell's call.

    direct_reads(block) -> [("self.fc2.weight", Parameter), ...]

A unit pins its parameters only while its own cells run (their forward hooks).
A construct that reads a descendant's Parameter without calling that
descendant — a block doing `ops.matmul(y, self.fc2.weight)`, a model reading
its tied embedding `self.transformer.wte.embedding_table`, a helper given the
cell (`linear(x, self.q_proj)`) — reads it outside that descendant's call,
where nothing pinned it: the page is unmapped and the kernel dies. The planner
(prefetchd/hooks/planner.py) keeps such a block whole, or pins the parameter in the
root unit.

Found from the construct's source with `ast`, following expressions that
start at `self`:
- attribute chains and constant indexes through sub-cells that reach a
  Parameter (`self.fc2.weight`, `self.blocks[0].fc1.weight`); metadata
  (`.shape`, `.dtype`, ...) reads no bytes and does not count;
- names bound to sub-cells by `for` loops and comprehensions (over a CellList,
  a tuple of sub-cells, `zip`, `enumerate`, `reversed`), by assignment, or by
  `getattr(self, name)` (a computed name stands for every attribute), then
  read through (`for lin in (self.q, self.k): lin.weight`);
- a sub-cell used any way other than called, iterated, bound to a name or
  given to `len`/`isinstance` (passed to a function, stored, returned) counts
  as reading all of its parameters: what the callee does is not known;
- a method called on `self` or on a sub-cell (`self.embed(x)` with a helper
  `embed`, `self.attn.project(y)`, an explicit `self.attn.construct(y)`) runs
  without that cell's hooks, so its body is read as part of the construct,
  with its `self` standing for that cell.
A construct without source (built at run time) reports nothing.

    compiled_calls(cell) -> [("self._mlp", owner, "_mlp", [("self.fc1", fc1), ...]), ...]

The `@mindspore.jit` methods (other than `construct`) that `cell`'s construct
calls, directly or through plain helper methods, each with the sub-cells its
body uses (called or otherwise). Those sub-cells run inside the method's
graph: MindSpore 2.10 compiles their forward hooks into it (a prefetchd hook
there fails to compile, and would run once at trace time, not at each call),
so none of them, nor any cell under them, may carry a prefetchd hook.
"""
import ast
import functools
import inspect
import textwrap
import types

from ..backend import framework

# Attributes of a Parameter that read no bytes from its storage.
METADATA = frozenset({"shape", "dtype", "ndim", "name", "itemsize", "nbytes", "requires_grad", "size",
                      "strides", "is_init", "param_info"})
ANY_ITEM = "[*]"      # a chain step: any item (a loop over a container, a computed index)
ANY_ATTR = ".*"       # a chain step: any attribute (getattr with a computed name)
CALL = "()"           # a chain step: the object is called here
OPAQUE = "?"          # a chain step: the object is used in a way not followed (all its parameters)
_HARMLESS = frozenset({"len", "isinstance", "hasattr", "type", "id"})
_PASS_ITEMS = frozenset({"reversed", "list", "tuple", "iter"})
_MAX_INLINE = 4       # depth of methods read as part of a construct


def direct_reads(cell):
    """(expression, Parameter) for each Parameter `cell`'s construct may read without a call
    of the sub-cell that owns it."""
    found = {}
    _collect(cell, type(cell).construct, (), found, depth=0, seen=set())
    return list(found.values())


def _collect(root, function, prefix, found, depth, seen):
    """Resolve `function`'s chains from `root`, each prefixed with `prefix`."""
    key = (function, id(root), prefix)
    if key in seen:
        return
    seen.add(key)
    for chain in _chains(function):
        for expr, obj, rest in _resolve(root, prefix + chain):
            _note(root, expr, obj, rest, found, depth, seen)


def _note(root, expr, obj, rest, found, depth, seen):
    ms = framework.mindspore()
    if isinstance(obj, ms.Parameter):
        if not (rest and rest[0] in METADATA | {CALL}):
            found.setdefault(id(obj), (expr, obj))
    elif isinstance(obj, ms.nn.Cell):
        if not rest or rest[0] == OPAQUE:         # not called: what reads it is not known
            for p in obj.get_parameters():
                found.setdefault(id(p), (f"{expr} (used other than called)", p))
    elif rest and rest[0] == CALL and inspect.ismethod(obj) and isinstance(obj.__self__, ms.nn.Cell):
        # A method of a cell called directly: its hooks do not run, so its body reads as ours.
        owner, method = obj.__self__, obj.__func__
        if _is_framework(method):
            return
        if depth >= _MAX_INLINE:
            for p in owner.get_parameters():
                found.setdefault(id(p), (f"{expr}() (not followed deeper)", p))
            return
        base = expr[:-len(obj.__name__) - 1]     # the owner's expression: "self.attn" of "self.attn.project"
        inner = {}
        _collect(owner, method, (), inner, depth + 1, seen)
        for pid, (e, p) in inner.items():
            found.setdefault(pid, (base + e[len("self"):], p))


def _is_framework(function):
    """Methods MindSpore itself defines (Cell's own API): they read no weights of the model."""
    function = inspect.unwrap(function)          # a @jit method: its wrapper is MindSpore's, not it
    module = getattr(function, "__module__", "") or ""
    return module.startswith("mindspore.")


@functools.lru_cache(maxsize=None)
def _chains(function):
    """The chains from the first argument (`self`) in a function's source; each a tuple of
    steps (attribute names, int indexes, ANY_ITEM, ANY_ATTR) ending, where known, in how
    the object is used (CALL, OPAQUE); a chain that simply ends is a plain read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if func is None or not func.args.args:
        return ()
    return tuple(sorted(_Walker(func).chains(), key=str))


class _Walker:
    """One function's chains: bindings of names to sub-cells first, then every use."""

    def __init__(self, func):
        self.me = func.args.args[0].arg
        self.func = func
        self.parent = {}
        for node in ast.walk(func):
            for child in ast.iter_child_nodes(node):
                self.parent[id(child)] = node
        self.env = {}               # name -> set of chains it may stand for
        for _ in range(3):          # nested loops bind names through names bound before
            self._bind()

    # ---------------------------------------------------------------- chains of expressions
    def chain(self, node):
        """The chains an expression stands for (a set), or None if it is not one."""
        if isinstance(node, ast.Name):
            if node.id == self.me:
                return {()}
            return self.env.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.chain(node.value)
            return None if base is None else {c + (node.attr,) for c in base}
        if isinstance(node, ast.Subscript):
            base = self.chain(node.value)
            if base is None:
                return None
            index = node.slice
            step = index.value if isinstance(index, ast.Constant) and isinstance(index.value, (int, str)) \
                else ANY_ITEM
            return {c + (step,) for c in base}
        if self._is_getattr(node):
            base = self.chain(node.args[0])
            if base is None:
                return None
            name = node.args[1]
            step = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else ANY_ATTR
            return {c + (step,) for c in base}
        return None

    @staticmethod
    def _is_getattr(node):
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2)

    def items(self, node):
        """Per position of a loop target, the chains an iterable's items stand for; None if unknown."""
        if isinstance(node, (ast.Tuple, ast.List)):
            out = set()
            for element in node.elts:
                c = self.chain(element)
                if c is None:
                    return None
                out |= c
            return [out]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name == "zip":
                per = [self.items(a) for a in node.args]
                return None if any(p is None for p in per) else [p[0] for p in per]
            if name == "enumerate" and node.args:
                inner = self.items(node.args[0])
                return None if inner is None else [set(), inner[0]]
            if name in _PASS_ITEMS and node.args:
                return self.items(node.args[0])
        c = self.chain(node)
        return None if c is None else [{x + (ANY_ITEM,) for x in c}]

    # ---------------------------------------------------------------- bindings
    def _bind(self):
        for node in ast.walk(self.func):
            if isinstance(node, (ast.For, ast.comprehension)):
                per = self.items(node.iter)
                if per is not None:
                    self._bind_target(node.target, per)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                c = self.chain(node.value)
                if c is not None and isinstance(node.targets[0], ast.Name):
                    self.env.setdefault(node.targets[0].id, set()).update(c)

    def _bind_target(self, target, per):
        if isinstance(target, ast.Name):
            self.env.setdefault(target.id, set()).update(set().union(*per))
        elif isinstance(target, (ast.Tuple, ast.List)):
            if len(per) == len(target.elts):
                for t, p in zip(target.elts, per):
                    self._bind_target(t, [p])
            else:
                for t in target.elts:
                    self._bind_target(t, per)

    # ---------------------------------------------------------------- uses
    def chains(self):
        out = set()
        for node in ast.walk(self.func):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                continue
            c = self.chain(node)
            if c is None or self._continued(node):
                continue
            use = self._use(node)
            if use is None:
                continue
            out |= {x + use for x in c}
        return out

    def _continued(self, node):
        """True if `node` is the start of a longer chain (the chain of its parent counts)."""
        parent = self.parent.get(id(node))
        if isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node:
            return self.chain(parent) is not None
        if self._is_getattr(parent) and parent.args[0] is node:
            return True
        return False

    def _use(self, node):
        """How a maximal chain is used: () a plain read, (CALL,), (OPAQUE,), or None: not a use."""
        parent = self.parent.get(id(node))
        if isinstance(parent, ast.Call):
            if parent.func is node:
                return (CALL,)
            if isinstance(parent.func, ast.Name) and parent.func.id in _HARMLESS:
                return None
            if isinstance(parent.func, ast.Name) and parent.func.id in _PASS_ITEMS | {"zip", "enumerate"} \
                    and self._is_loop_iter(parent):
                return None
            return (OPAQUE,)
        if isinstance(parent, (ast.For, ast.comprehension)) and parent.iter is node:
            return None                               # its items are bound to the loop target
        if isinstance(parent, (ast.Tuple, ast.List)) and self._is_loop_iter(parent):
            return None
        if isinstance(parent, ast.Assign) and parent.value is node and \
                all(isinstance(t, ast.Name) for t in parent.targets):
            return None                               # bound to a name; its uses count
        if isinstance(parent, (ast.Compare, ast.BoolOp)) or (
                isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)) and parent.test is node) or (
                isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)):
            return None                               # `self.head is None`, `if self.downsample:`
        return ()

    def _is_loop_iter(self, node):
        parent = self.parent.get(id(node))
        if isinstance(parent, (ast.For, ast.comprehension)) and parent.iter is node:
            return True
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and \
                parent.func.id in _PASS_ITEMS | {"zip", "enumerate"}:
            return self._is_loop_iter(parent)
        return False


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


def _resolve(root, chain):
    """Follow `chain` from `root`: (expression, object reached, the steps after it) for each
    object a Parameter, a cell used as the chain says, or a method called."""
    ms = framework.mindspore()
    out = []

    def follow(obj, expr, i):
        if isinstance(obj, ms.Parameter) or i == len(chain) or chain[i] in (CALL, OPAQUE):
            out.append((expr, obj, chain[i:]))
            return
        step = chain[i]
        if step == ANY_ITEM:
            for label, item in _items(obj):
                follow(item, expr + label, i + 1)
        elif step == ANY_ATTR:
            if isinstance(obj, ms.nn.Cell):
                for label, item in _attributes(obj):
                    follow(item, expr + label, i + 1)
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


def is_jit(function):
    """True if `function` is wrapped by mindspore.jit (MindSpore marks the wrapper)."""
    return bool(getattr(function, "__wrapped_by_jit__", False))


def compiled_calls(cell):
    """(method expression, owner cell, method name, [(expression, sub-cell)]) for each
    @jit method `cell`'s construct calls (through plain helpers too), with the sub-cells
    run inside its graph. A compiled construct itself is not reported (the planner
    treats the whole cell as compiled)."""
    found = {}
    if not is_jit(cell.construct):
        _walk_calls(cell, type(cell).construct, (), "self", found, None, 0, set())
    return [(expr, owner, name, list(cells.values())) for expr, owner, name, cells in found.values()]


def _walk_calls(root, function, prefix, base, found, inside, depth, seen):
    """Follow `function`'s chains from `root` (written `base`); `inside`: the key in `found`
    of the jit method whose graph this body runs in, or None."""
    ms = framework.mindspore()
    key = (function, id(root), inside)
    if key in seen or depth > _MAX_INLINE:
        return
    seen.add(key)
    for chain in _chains(function):
        for expr, obj, rest in _resolve(root, prefix + chain):
            expr = base + expr[len("self"):]
            if isinstance(obj, ms.nn.Cell):
                if inside is not None:
                    found[inside][3].setdefault(id(obj), (expr, obj))
            elif rest and rest[0] == CALL and inspect.ismethod(obj) and isinstance(obj.__self__, ms.nn.Cell) \
                    and not _is_framework(obj.__func__):
                owner, method = obj.__self__, obj.__func__
                owner_expr = expr[:-len(obj.__name__) - 1]
                if inside is None and is_jit(method):
                    here = (id(owner), method)
                    found.setdefault(here, (expr, owner, obj.__name__, {}))
                    _walk_calls(owner, method, (), owner_expr, found, here, depth + 1, seen)
                else:
                    _walk_calls(owner, method, (), owner_expr, found, inside, depth + 1, seen)
