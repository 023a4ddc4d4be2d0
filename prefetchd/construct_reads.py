"""Parameters a cell's construct reads directly, not through a sub-cell's call.

    direct_reads(block) -> [("self.fc2.weight", Parameter), ...]

A unit pins its parameters only while its own cells run (their forward hooks).
A construct that reads a descendant's Parameter by attribute — a block doing
`ops.matmul(y, self.fc2.weight)`, a model reading its tied embedding
`self.transformer.wte.embedding_table` — reads it outside that descendant's
call, where nothing pinned it: the page is unmapped and the kernel dies. The
planner (prefetchd/planner.py) keeps such a block whole, or pins the
parameter in the root unit.

Found from the construct's source with `ast`: attribute chains starting at
`self` and going through sub-cells (and constant indexes into a CellList or
SequentialCell) that reach a Parameter. Metadata (`self.norm.weight.shape`,
`.dtype`) reads no bytes and does not count. Dynamic access (getattr with a
computed name, a loop variable bound to a sub-cell) is not seen, and a
construct without source (built at run time) reports nothing.
"""
import ast
import functools
import inspect
import textwrap

from .backend import framework

# Attributes of a Parameter that read no bytes from its storage.
METADATA = frozenset({"shape", "dtype", "ndim", "name", "itemsize", "nbytes", "requires_grad", "size",
                      "strides", "is_init", "param_info"})


def direct_reads(cell):
    """(expression, Parameter) for each Parameter `cell`'s construct reaches by attribute."""
    chains = _chains(type(cell).construct)
    found = {}
    for chain in chains:
        hit = _resolve(cell, chain)
        if hit is not None:
            expr, param, rest = hit
            if not (rest and rest[0] in METADATA):
                found.setdefault(id(param), (expr, param))
    return list(found.values())


@functools.lru_cache(maxsize=None)
def _chains(construct):
    """The attribute/index chains from the first argument (`self`) in a construct's source."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(construct)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if func is None or not func.args.args:
        return ()
    me = func.args.args[0].arg
    # Only whole chains: skip a node that an attribute or a constant index continues
    # (`self.fc2` inside `self.fc2.weight`), so what follows a Parameter is known.
    continued = {id(n.value) for n in ast.walk(func) if _chain_step(n)}
    chains = set()
    for node in ast.walk(func):
        chain = None if id(node) in continued else _chain(node, me)
        if chain:
            chains.add(chain)
    return tuple(sorted(chains, key=str))


def _chain_step(node):
    return isinstance(node, ast.Attribute) or (
        isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, int))


def _chain(node, me):
    """('fc2', 'weight') for `self.fc2.weight`; ints for constant indexes; None otherwise."""
    steps = []
    while True:
        if isinstance(node, ast.Attribute):
            steps.append(node.attr)
            node = node.value
        elif _chain_step(node):
            steps.append(node.slice.value)
            node = node.value
        elif isinstance(node, ast.Name) and node.id == me:
            return tuple(reversed(steps)) or None
        else:
            return None


def _member(cell, name):
    """A cell's Parameter, sub-cell or plain attribute `name`, without calling anything
    (no truth test either: a Parameter's truth value is an error for more than one element)."""
    for table in (cell.__dict__.get("_params", {}), cell.__dict__.get("_cells", {}), cell.__dict__):
        if name in table:
            return table[name]
    return None


def _resolve(cell, chain):
    """Follow `chain` from `cell` through sub-cells; (expression, Parameter, the steps after
    it) where it reaches one."""
    ms = framework.mindspore()
    obj, expr = cell, "self"
    for i, step in enumerate(chain):
        if isinstance(step, int):
            try:
                obj = obj[step] if isinstance(obj, (ms.nn.CellList, ms.nn.SequentialCell, list, tuple)) else None
            except IndexError:
                return None
            expr += f"[{step}]"
        elif isinstance(obj, ms.nn.Cell):
            obj = _member(obj, step)
            expr += f".{step}"
        else:
            return None
        if isinstance(obj, ms.Parameter):
            return expr, obj, chain[i + 1:]
        if obj is None:
            return None
    return None
