"""Walking a cell's output: its Tensors in a fixed order, and the same output with some of
them replaced.

Model outputs nest: tuples, lists, dicts (a transformers ModelOutput), namedtuples,
dataclass instances and SimpleNamespaces, sometimes with a cycle (a parent pointer).
`flat_tensors` numbers the Tensors in one order; `replaced` rebuilds the containers on
the way with new Tensors at chosen positions of that order. Used for the outputs that
are views of a unit's weights (prefetchd/hooks/views.py) and for the Tensors passed
through the model's backward pre-hook (prefetchd/hooks/backward.py).
"""
import copy
import dataclasses
import itertools
import types

from ..backend import framework


def flat_tensors(value, _seen=None):
    """The tensors in `value` (nested tuples, lists, dict values, and the fields of
    dataclass instances and SimpleNamespaces: model outputs), in a fixed order. A container
    met again (a cycle: a parent pointer) is not walked again."""
    if framework.is_tensor(value):
        return [value]
    items = _items(value)
    if items is None:
        return []
    seen = set() if _seen is None else _seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    return [t for v in items for t in flat_tensors(v, seen)]


def _items(value):
    """The values a container holds, in order; None for anything else."""
    if isinstance(value, (tuple, list)):
        return value
    if isinstance(value, dict):
        return list(value.values())
    fields = _fields(value)
    return None if fields is None else list(fields.values())


def _fields(value):
    """{name: value} of a dataclass instance's fields or a SimpleNamespace's attributes;
    None for anything else (an arbitrary object is not walked: a cache may hold thousands)."""
    if isinstance(value, types.SimpleNamespace):
        return vars(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if hasattr(value, f.name)}
    return None


def replaced(output, positions, make):
    """`output` rebuilt with make(tensor) for the Tensor at each of `positions` (of
    flat_tensors(output)); every position when `positions` is None. Containers are
    copied where they can be (the caller may still hold the original); _rebuilt says
    what happens to one that cannot."""
    wanted = None if positions is None else set(positions)
    counter = itertools.count()
    copies = {}                          # id(container) -> its copy

    def rebuild(value):
        if framework.is_tensor(value):
            return make(value) if wanted is None or next(counter) in wanted else value
        if _items(value) is None:
            return value
        if id(value) not in copies:
            copies[id(value)] = value        # a cycle back to a tuple or dict being built: itself
            copies[id(value)] = _rebuilt(value, rebuild, copies)
        return copies[id(value)]

    return rebuild(output)


def _rebuilt(value, rebuild, copies):
    """A copy of the container `value` holding rebuild(item) for each item. A list, dict,
    dataclass instance or SimpleNamespace is made, and entered in `copies`, before its
    items are rebuilt: a cycle back to it (a parent pointer) reaches the copy. A class is
    called with the new items only where that is checked to give them back (an output class
    whose __init__ takes its fields got a generator of pairs as its first one); a container
    that cannot be copied is changed in place; one nothing works for is kept as it is."""
    if isinstance(value, (dict, list)):     # (a dict: also a model-output class, a dataclass too)
        new = copies[id(value)] = _shallow_copy(value)
        pairs = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        pairs = [(key, item, rebuild(item)) for key, item in pairs]
        try:
            for key, item, rebuilt in pairs:
                if rebuilt is not item:
                    new[key] = rebuilt
            return new
        except Exception:                   # an immutable mapping: made again from its pairs
            made = _made(value, [(key, rebuilt) for key, _, rebuilt in pairs]
                         if isinstance(value, dict) else [rebuilt for _, _, rebuilt in pairs])
            return value if made is None else made
    fields = _fields(value)
    if fields is not None:
        new = copies[id(value)] = copy.copy(value)
        for name, v in fields.items():
            object.__setattr__(new, name, rebuild(v))     # (a frozen dataclass refuses setattr)
        return new
    items = [rebuild(v) for v in value]
    if type(value) is tuple:
        return tuple(items)
    made = _made(value, items, star=hasattr(value, "_make"))     # a namedtuple takes its fields
    if made is not None and getattr(value, "__dict__", None):
        made.__dict__.update(value.__dict__)          # (a subclass's instance attributes)
    return value if made is None else made


def _made(value, contents, star=False):
    """type(value)(contents), or None unless that gives back the same kind of container
    holding exactly `contents` (pairs for a mapping)."""
    try:
        made = type(value)(*contents) if star else type(value)(contents)
    except Exception:
        return None
    if type(made) is not type(value):
        return None
    got = list(made.items()) if isinstance(made, dict) else list(made)
    same = len(got) == len(contents) and all(
        (a[0] == b[0] and a[1] is b[1]) if isinstance(made, dict) else a is b for a, b in zip(got, contents))
    return made if same else None


def _shallow_copy(value):
    """copy.copy(value) if it gives the same kind of container with the same keys (a
    defaultdict, a ModelOutput, a dict subclass); else `value` itself, to change in place."""
    try:
        new = copy.copy(value)
    except Exception:
        return value
    same = type(new) is type(value) and len(new) == len(value)
    if same and isinstance(value, dict):
        same = list(new.keys()) == list(value.keys())
    return new if same and new is not value else value
