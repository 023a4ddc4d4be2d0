"""An offloaded model called in graph mode: refused by name.

offload() refuses a model while MindSpore is in graph mode, but the mode can be set
after it (`mindspore.set_context(mode=mindspore.GRAPH_MODE)`). In graph mode
`Cell.__call__` compiles the cell and runs the graph (`Cell.compile_and_run`) without
calling a forward hook, so no prefetchd hook would pin a weight, and the weights it
has offloaded are not resident: MindSpore's compile then failed with "Unable to cast
Python instance of type <class 'NoneType'> to C++ type 'std::string'", saying nothing
of why. Each cell of the model that holds parameters gets an instance attribute
`compile_and_run` that refuses instead; graph mode calls it, PyNative never does. It
stays after close(): a closed model refuses to run in either mode.
"""
from ..errors import PrefetchdError


def refuse_graph_calls(model):
    """Make a graph-mode call of `model`, or of any of its cells that holds parameters,
    raise a PrefetchdError naming the cell (its path in the model)."""
    for name, cell in model.cells_and_names():
        if next(cell.get_parameters(), None) is not None:
            object.__setattr__(cell, "compile_and_run", _Refusal(name or type(model).__name__))


class _Refusal:
    """A cell's `compile_and_run` in graph mode: raises, saying why and what to do."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise PrefetchdError(
            f"prefetchd: {self.name!r} was called in graph mode, but its model is offloaded "
            f"(prefetchd.offload), which streams weights in PyNative mode only: in graph mode "
            f"MindSpore compiles a cell without running its forward hooks, and its offloaded "
            f"weights are not resident. Call mindspore.set_context(mode=mindspore.PYNATIVE_MODE) "
            f"before calling it (compile blocks with @mindspore.jit instead: they stream whole)")
