"""The steps of a chain (prefetchd.analysis.source_chains): attribute names, constant indexes
and the markers below, and how the chain of an item of what a chain stands for is taken."""
import ast

ANY_ITEM = "[*]"      # a chain step: any item (a loop over a container, a computed index)
ANY_ATTR = ".*"       # a chain step: any attribute (getattr with a computed name)
PARAMS = "<params>"   # a chain step: each parameter under the cell (cell.get_parameters())
LISTED = "[...]"      # a chain step: a list or tuple of the object, built in the function
SLICED = "[:]"        # a chain step: a slice of the container (its items, some of them, any order)
SUPER = "super()"     # a chain's first step: super() in a method, the argument seen as its parent class
CALL = "()"           # a chain step: the object is called here
OPAQUE = "?"          # a chain step: the object is used in a way not followed (all its parameters)
PASSED = "->"         # first item of a (PASSED, callee, slot) step: handed to a callee
FORMATTED = "{}"      # a chain step: formatted into an f-string (a cell's repr reads no weights)
RETURNED = "<return>" # a chain step: returned (the caller's use of the result counts)


def is_passed(step):
    return isinstance(step, tuple) and len(step) == 3 and step[0] == PASSED


def union(per):
    """Every chain of a loop target's positions (items()), nested ones included."""
    return set().union(*[union(p) if isinstance(p, list) else p for p in per])


def constant_index(index):
    """A subscript's constant index (an int, negative ones included, or a str), else ANY_ITEM."""
    if isinstance(index, ast.Constant) and isinstance(index.value, (int, str)) \
            and not isinstance(index.value, bool):
        return index.value
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub) \
            and isinstance(index.operand, ast.Constant) and type(index.operand.value) is int:
        return -index.operand.value
    return ANY_ITEM


def item_of(chain, step):
    """The chain of an item (`step`: an index, or ANY_ITEM) of what `chain` stands for: of a
    list the function built (LISTED), the object it was built of; of a slice (SLICED), any
    item of the container it was taken of (its indexes are renumbered)."""
    if chain and chain[-1] == SLICED:
        chain, step = chain[:-1], ANY_ITEM
    return chain[:-1] if chain and chain[-1] == LISTED else chain + (step,)
