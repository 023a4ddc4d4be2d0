"""The chains of attribute steps a function's source takes from one of its arguments.

    chains(function, arg=None) -> (("fc2", "weight", "()"), ("blocks", "[*]", "()"), ...) or None

Read from the source with `ast`, no object is touched: each chain starts at the
argument `arg` (default: the first, a method's `self`) and is a tuple of steps:
attribute names, constant indexes (int, negative ones too, or str), ANY_ITEM (a loop
over it, a computed index), ANY_ATTR (getattr with a computed name), PARAMS (the
cell's `get_parameters()` and friends: every parameter under it), LISTED (a Python
list or tuple the function builds of the object, `layers = [self.blocks[-1] for _ in
range(n)]`: its items, looped over or indexed, are the object itself; any other use
of the list is a use of the object not followed), ending, where known, in how the
object is used:

- CALL: called here (`self.fc1(x)`, a method `self.embed(x)`), then, for a method
  whose result is itself called or returned (`self.get_input_embeddings()(ids)`),
  CALL or RETURNED again: what happens to the result;
- RETURNED: returned by the function (`return self.embed_tokens`): what the caller
  does with it says whether it is read;
- PASSED: a (PASSED, callee, slot) step: handed to a function, a method or a
  callable attribute as argument `slot` (a position or a keyword), where
  `callee` says how to find it: ("name", "helper"), ("dotted", ("mod", "fn")),
  ("self", chain) for a callable reached from the argument itself
  (`self.processor(self, x)`), ("values", callee) for any value of a mapping
  (`FUNCTIONS[key]`), or ("any", (local name, callees)) for a local name every
  assignment of which binds one of those (transformers' `attention_interface =
  eager_attention_forward`, else `= ALL_ATTENTION_FUNCTIONS[impl]`);
  prefetchd.hooks.construct_reads follows it;
- FORMATTED: formatted into an f-string (`f"{self} is used as a decoder"`);
- OPAQUE: used in a way that is not followed (`*args`, a callee not named);
- nothing: a plain read (`ops.matmul(x, self.w)`'s `self.w` is PASSED to
  ops.matmul: for a Parameter any such use reads it).

Names bound to chains by `for` loops, comprehensions, assignment, `zip`,
`enumerate`, `reversed`, `next` are followed through, and so are names bound once to
such an iterable (`blocks = list(zip(self.resnets, self.attentions))`, then `for r, a
in blocks`; any other use of the name reads all it holds); a slice (`self.blocks[1:]`,
SLICED) stands for the container it is taken of, and an index into it for any of its
items. `None` means the source could not be read (built at run time, a lambda): the
caller decides what is safe.
"""
import ast
import collections
import functools
import inspect
import textwrap

from .chain_steps import (ANY_ATTR, ANY_ITEM, CALL, FORMATTED, LISTED, OPAQUE, PARAMS, PASSED, RETURNED, SLICED,
                          SUPER, constant_index, item_of, union)

_HARMLESS = frozenset({"len", "isinstance", "hasattr", "type", "id"})
_PASS_ITEMS = frozenset({"reversed", "list", "tuple", "iter"})
_ITEM_ITERATORS = frozenset({"items", "values", "cells"})     # CellDict's, a CellList's cells()
# Cell methods that yield its parameters (MindSpore's, and the torch spellings mindone keeps).
_PARAM_ITERATORS = frozenset({"get_parameters", "trainable_params", "untrainable_params", "parameters_and_names",
                              "parameters_dict", "parameters", "named_parameters"})
_NAMED_PARAM_ITERATORS = frozenset({"parameters_and_names", "named_parameters"})   # (name, parameter) pairs


@functools.lru_cache(maxsize=None)
def chains(function, arg=None):
    """The chains from argument `arg` (default: the first) in `function`'s source, sorted; None
    if its source cannot be read or parsed, or it names no such argument."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if func is None:
        return None
    names = [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]
    me = names[0] if arg is None and names else arg
    if me not in names:
        return None
    return tuple(sorted(_Walker(func, me).chains(), key=str))


class _Walker:
    """One function's chains: bindings of names to chains first, then every use."""

    def __init__(self, func, me):
        self.me = me
        self.func = func
        first = (func.args.posonlyargs + func.args.args)[:1]
        self.super_is_me = bool(first) and first[0].arg == me    # zero-argument super() binds it
        self.parent = {}
        for node in ast.walk(func):
            for child in ast.iter_child_nodes(node):
                self.parent[id(child)] = node
        self.env = {}               # name -> set of chains it may stand for
        self.iterables = {}         # name bound once to an iterable of chains -> items() of it
        self._stores = collections.Counter(n.id for n in ast.walk(func)
                                           if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load))
        for _ in range(3):          # nested loops bind names through names bound before
            self._bind()
        self.local_names = _locals(func, self._stores)
        # local name -> the callees it may be bound to
        self.aliases = _callee_aliases(func, self.local_names, self._stores, self.env)

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
            if isinstance(node.slice, ast.Slice):  # some of the container's items, renumbered
                return {c if c and c[-1] in (LISTED, SLICED) else c + (SLICED,) for c in base}
            return {item_of(c, constant_index(node.slice)) for c in base}
        if self._is_getattr(node):
            base = self.chain(node.args[0])
            if base is None:
                return None
            name = node.args[1]
            step = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else ANY_ATTR
            return {c + (step,) for c in base}
        if self._is_param_iterator(node):
            base = self.chain(node.func.value)
            return None if base is None else {c + (PARAMS,) for c in base}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super" \
                and not node.args and not node.keywords and self.super_is_me:
            return {(SUPER,)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next" \
                and len(node.args) == 1:
            per = self.items(node.args[0])
            return None if per is None else union(per)
        return None

    @staticmethod
    def _is_getattr(node):
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2)

    @staticmethod
    def _is_param_iterator(node):
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _PARAM_ITERATORS)

    def items(self, node):
        """Per position of a loop target, the chains an iterable's items stand for (a set, or a
        list of them for a position that is itself a tuple: enumerate(zip(...))); None if unknown."""
        if isinstance(node, ast.Name) and node.id in self.iterables:
            return self.iterables[node.id]
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
            if name == "zip":            # (an argument not followed: its position binds nothing)
                per = [self.items(a) for a in node.args]
                return [set() if p is None else p[0] if len(p) == 1 else p for p in per]
            if name == "enumerate" and node.args:
                inner = self.items(node.args[0])
                return None if inner is None else [set(), inner[0] if len(inner) == 1 else inner]
            if name in _PASS_ITEMS and node.args:
                return self.items(node.args[0])
        if self._is_param_iterator(node) and node.func.attr in _NAMED_PARAM_ITERATORS:
            # (name, parameter): the name is a string. Bound to the parameters too, `m in name`
            # (mindone.diffusers' get_parameter_dtype) read every weight of the model.
            c = self.chain(node)
            return None if c is None else [set(), {item_of(x, ANY_ITEM) for x in c}]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
            # A cell container's own iterators: blocks.values() / .cells(), blocks.items() /
            # .name_cells().items() (name, cell), as a loop over the container's items.
            method, owner = node.func.attr, node.func.value
            if method == "items" and isinstance(owner, ast.Call) and isinstance(owner.func, ast.Attribute) \
                    and owner.func.attr == "name_cells" and not owner.args:
                base = self.chain(owner.func.value)
                return None if base is None else [set(), {c + (ANY_ATTR,) for c in base}]
            base = self.chain(owner) if method in _ITEM_ITERATORS else None
            if base is not None:
                items = {item_of(c, ANY_ITEM) for c in base}
                return [set(), items] if method == "items" else [items]
        c = self.chain(node)
        return None if c is None else [{item_of(x, ANY_ITEM) for x in c}]

    def listed(self, node):
        """The chains of the items of a list or tuple built of chains only (a display, or
        a list comprehension of one), None if `node` is no such thing."""
        if isinstance(node, ast.ListComp):
            return self.chain(node.elt)
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            per = [self.chain(element) for element in node.elts]
            return None if any(c is None for c in per) else set().union(*per)
        return None

    # ---------------------------------------------------------------- bindings
    def _bind(self):
        for node in ast.walk(self.func):
            if isinstance(node, (ast.For, ast.comprehension)):
                per = self.items(node.iter)
                if per is not None:
                    self._bind_target(node.target, per)
            elif isinstance(node, ast.Assign) and _to_names(node):     # (`a = b = self.x`: both)
                c = self.chain(node.value)
                listed = self.listed(node.value)
                if listed is not None:
                    c = {x + (LISTED,) for x in listed}
                for target in node.targets if c is not None else ():
                    self.env.setdefault(target.id, set()).update(c)
                if c is None and _is_iterating_call(node.value):
                    per = self.items(node.value)
                    for target in node.targets if per is not None else ():
                        if self._stores[target.id] == 1:     # (bound again: not followed)
                            self.iterables[target.id] = per

    def _bind_target(self, target, per):
        if isinstance(target, ast.Name):
            chains = union(per)
            if len(per) > 1:           # one name for a tuple of positions (`for pair in zip(a, b)`):
                chains = {c + (LISTED,) for c in chains}     # pair[1] is any of them
            self.env.setdefault(target.id, set()).update(chains)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if len(per) == len(target.elts):
                for t, p in zip(target.elts, per):
                    self._bind_target(t, p if isinstance(p, list) else [p])
            else:
                for t in target.elts:
                    self._bind_target(t, per)

    # ---------------------------------------------------------------- uses
    def chains(self):
        out = set()
        for node in ast.walk(self.func):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                continue
            if isinstance(node, ast.Name) and node.id in self.iterables:
                if not self._is_loop_iter(node) and self._use(node) is not None:
                    out |= {x + (OPAQUE,) for x in union(self.iterables[node.id])}
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
        if isinstance(parent, ast.Attribute) and self._is_param_iterator(self.parent.get(id(parent))):
            return True                               # self.blocks.get_parameters(): PARAMS counts
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "next" \
                and self.chain(parent) is not None:
            return True
        return False

    def _use(self, node):
        """How a maximal chain is used: () a plain read, (CALL,), (OPAQUE,), ((PASSED, callee,
        slot),), or None: not a use."""
        parent = self.parent.get(id(node))
        if isinstance(parent, ast.FormattedValue) and parent.value is node:
            return (FORMATTED,)                       # f"... {self} ...": an error message
        if isinstance(parent, ast.keyword):
            call = self.parent.get(id(parent))
            callee = self._callee(call.func)
            if parent.arg is None or callee is None:
                return (OPAQUE,)                      # **kwargs, or a callee not followed
            return ((PASSED, callee, parent.arg),)
        if isinstance(parent, ast.Call):
            if parent.func is node:
                return (CALL,) + self._result_use(parent)
            if isinstance(parent.func, ast.Name) and parent.func.id in _HARMLESS:
                return None
            if _is_iterating_call(parent) and self._is_loop_iter(parent):
                return None
            callee = self._callee(parent.func)
            slot = self._slot(parent, node)
            if callee is None or slot is None:
                return (OPAQUE,)
            return ((PASSED, callee, slot),)
        if isinstance(parent, (ast.For, ast.comprehension)) and parent.iter is node:
            return None                               # its items are bound to the loop target
        if isinstance(parent, (ast.Tuple, ast.List)) and self._is_loop_iter(parent) \
                and self.listed(parent) is not None:
            return None                               # every item bound to the loop target
        if isinstance(parent, ast.Assign) and parent.value is node and _to_names(parent):
            return None                               # bound to a name; its uses count
        if self._is_bound_list_item(node, parent):
            return None                               # `layers = [self.a, self.b]`: the list's uses count
        if isinstance(parent, ast.Return) and parent.value is node:
            return (RETURNED,)
        if isinstance(parent, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in parent.ops):
            return None                               # `self.head is None` (`w[0] > 0` reads w)
        if self._only_tested(node):
            return None                               # `if self.downsample:`, `if self.a and self.b:`
        return ()

    def _result_use(self, call):
        """(CALL,) if `call`'s result is called at once (`self.get_input_embeddings()(ids)`),
        (RETURNED,) if it is returned, else ()."""
        parent = self.parent.get(id(call))
        if isinstance(parent, ast.Call) and parent.func is call:
            return (CALL,)
        if isinstance(parent, ast.Return) and parent.value is call:
            return (RETURNED,)
        return ()

    def _only_tested(self, node):
        """Whether `node`'s value is only tested for truth: an if/while/assert test, `not`, or
        an operand of and/or that is itself one (`w = self.tie and self.w` hands w on)."""
        parent = self.parent.get(id(node))
        if isinstance(parent, ast.BoolOp):
            return self._only_tested(parent)
        return (isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)) and parent.test is node
                or isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not))

    def _callee(self, func):
        """How to find a call's callee: ("name", n), ("dotted", names), ("self", chain), ("any",
        (name, callees)) for a local alias (_callee_aliases), or None."""
        if isinstance(func, ast.Name) and func.id in self.aliases:
            return ("any", (func.id, self.aliases[func.id]))
        if isinstance(func, ast.Name) and func.id != self.me and func.id not in self.env:
            # (a local of another kind, a parameter: not the global of that name)
            return None if func.id in self.local_names else ("name", func.id)
        c = self.chain(func)
        if c is not None:
            return ("self", next(iter(c))) if len(c) == 1 else None
        names = []
        while isinstance(func, ast.Attribute):
            names.append(func.attr)
            func = func.value
        if isinstance(func, ast.Name) and func.id not in self.env and func.id not in self.local_names:
            return ("dotted", tuple([func.id] + names[::-1]))
        return None

    @staticmethod
    def _slot(call, node):
        """The position of argument `node` in `call`, or None after a *starred argument."""
        for i, a in enumerate(call.args):
            if isinstance(a, ast.Starred):
                return None
            if a is node:
                return i
        return None

    def _is_bound_list_item(self, node, parent):
        """Whether `node` is an item of a list or tuple bound to a name as chains (_bind)."""
        if not (isinstance(parent, ast.ListComp) and parent.elt is node
                or isinstance(parent, (ast.List, ast.Tuple)) and node in parent.elts):
            return False
        assign = self.parent.get(id(parent))
        return (isinstance(assign, ast.Assign) and assign.value is parent and _to_names(assign)
                and self.listed(parent) is not None)

    def _is_loop_iter(self, node):
        """Whether `node`'s items are bound to names: it is iterated by a loop, or bound as
        an iterable (self.iterables), maybe through zip / enumerate / list / ..."""
        parent = self.parent.get(id(node))
        if isinstance(parent, (ast.For, ast.comprehension)) and parent.iter is node:
            return True
        if isinstance(parent, ast.Assign) and parent.value is node and _to_names(parent):
            return all(t.id in self.iterables for t in parent.targets)
        if _is_iterating_call(parent):
            return self._is_loop_iter(parent)
        return False


def _locals(func, stores):
    """Every name `func` binds itself: a callee by such a name is not the global one."""
    args = func.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg] if a}
    for node in ast.walk(func):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not func:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names | set(stores)


def _callee_aliases(func, local_names, stores, env):
    """Local names bound, by every assignment of them, to a function named from outside
    (a global, a dotted name, an item of a mapping): what calling the name may call."""
    found = collections.defaultdict(list)
    for node in ast.walk(func):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if value is not None and len(targets) == 1 and isinstance(targets[0], ast.Name):
            callee = _outside_callee(value, local_names)
            found[targets[0].id].append(callee if callee is not None else False)
    return {name: tuple(dict.fromkeys(callees)) for name, callees in found.items()
            if all(callees) and len(callees) == stores[name] and name not in env}


def _outside_callee(node, local_names):
    """("name", n), ("dotted", names) or ("values", either) of an expression naming a
    function from outside the function (`FUNCTIONS[key]`: any value); None otherwise."""
    if isinstance(node, ast.Subscript):
        inner = _outside_callee(node.value, local_names)
        return None if inner is None or inner[0] == "values" else ("values", inner)
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id in local_names:
        return None
    return ("dotted", tuple([node.id] + names[::-1])) if names else ("name", node.id)


def _is_iterating_call(node):
    """zip(...), enumerate(...), list(...), reversed(...), ...: an iterable of its arguments' items."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id in _PASS_ITEMS | {"zip", "enumerate"}


def _to_names(assign):
    """Whether an assignment binds its value to plain names only (`a = b = value`)."""
    return all(isinstance(t, ast.Name) for t in assign.targets)
