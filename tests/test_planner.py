"""The unit planner on its own: which cells stream together, and what is refused up front."""
import pytest

from prefetchd.errors import BudgetError, PrefetchdError
from prefetchd.planner import ROOT_NAME, param_nbytes, plan_units


@pytest.fixture
def nets(ms):
    nn = ms.nn

    class Block(nn.Cell):
        def __init__(self, d):
            super().__init__()
            self.a = nn.Dense(d, d)
            self.b = nn.Dense(d, d)

        def construct(self, x):
            return self.b(self.a(x))

    class Inner(nn.Cell):
        def __init__(self, d, n):
            super().__init__()
            self.embed = nn.Embedding(100, d)
            self.pos = nn.Embedding(10, d)                  # two Embeddings: leaves, not blocks
            self.h = nn.CellList([Block(d) for _ in range(n)])

    class Outer(nn.Cell):
        def __init__(self, d=32, n=4):
            super().__init__()
            self.transformer = Inner(d, n)
            self.scale = ms.Parameter(ms.Tensor([1.0], ms.float32), name="scale")

    class Siblings(nn.Cell):                                # repeated composite siblings, no container
        def __init__(self, d=32):
            super().__init__()
            self.first, self.second, self.head = Block(d), Block(d), nn.Dense(d, 2)

    return Block, Outer, Siblings


def nbytes(cell):
    return sum(param_nbytes(p) for p in cell.get_parameters())


def roomy(model, block):
    """A high watermark where a block is within its share but two blocks are not (no merging)."""
    return nbytes(model) + 6 * nbytes(block)


def test_nested_blocks_are_units_and_the_rest_is_the_root(nets):
    _, outer, _ = nets
    model = outer()
    plan = plan_units(model, high_watermark=roomy(model, model.transformer.h[0]), lookahead=2)
    assert [u.name for u in plan.units] == [f"transformer.h.{i}" for i in range(4)]
    assert set(plan.root.param_names) == {"scale", "transformer.embed.embedding_table",
                                          "transformer.pos.embedding_table"}
    every = {p.name for p in model.get_parameters()}
    assert every == set(plan.root.param_names) | {n for u in plan.units for n in u.param_names}
    assert plan.total_bytes == sum(param_nbytes(p) for p in model.get_parameters())
    table = plan.format_table()
    assert ROOT_NAME in table and "transformer.h.3" in table


def test_repeated_sibling_blocks_are_found(nets):
    _, _, siblings = nets
    model = siblings()
    plan = plan_units(model, nbytes(model.head) + 6 * nbytes(model.first), 2)
    assert [u.name for u in plan.units] == ["first", "second"]
    assert plan.root.param_names == ["head.weight", "head.bias"]


def test_a_unit_above_its_share_is_split_and_no_split_keeps_it(nets):
    block, outer, _ = nets
    model = outer()
    one_block = nbytes(model.transformer.h[0])
    root = nbytes(model) - 4 * one_block
    high = root + 4 * one_block * 3 // 4                   # share = 3/4 of a block
    plan = plan_units(model, high, 2)
    assert [u.name for u in plan.units][:2] == ["transformer.h.0.a", "transformer.h.0.b"]
    assert all(u.nbytes <= plan.unit_share for u in plan.units)
    kept = plan_units(model, high, 2, no_split=(block,))
    assert [u.name for u in kept.units] == [f"transformer.h.{i}" for i in range(4)]


def test_tiny_neighbours_are_merged(ms):
    nn = ms.nn
    model = nn.SequentialCell([nn.Dense(4, 4) for _ in range(6)])
    plan = plan_units(model, 1 << 20, 2)
    assert len(plan.units) == 1 and plan.units[0].name == "0+1+2+3+4+5"
    assert len(plan.units[0].cells) == 6


def test_explicit_units_and_bad_names(nets):
    _, outer, _ = nets
    model = outer()
    plan = plan_units(model, 1 << 30, 2, units=["transformer.h.0", ("pos", model.transformer.pos)])
    assert [u.name for u in plan.units] == ["transformer.h.0", "pos"] and plan.explicit
    assert "transformer.h.1.a.weight" in plan.root.param_names
    with pytest.raises(PrefetchdError, match="no cell named 'nope'"):
        plan_units(model, 1 << 30, 2, units=["nope"])
    with pytest.raises(PrefetchdError, match="inside unit 'transformer.h.0'"):
        plan_units(model, 1 << 30, 2, units=["transformer.h.0", "transformer.h.0.a"])


def test_a_shared_parameter_is_listed_in_every_unit(ms):
    nn = ms.nn
    model = nn.CellList([nn.Dense(64, 64) for _ in range(3)])
    model[2].weight = model[0].weight
    plan = plan_units(model, 6 * nbytes(model[1]), 2)
    assert model[0].weight.name in plan.units[0].param_names
    assert model[0].weight.name in plan.units[2].param_names


def test_refusals_name_the_tensor_and_the_units(nets, ms):
    _, outer, _ = nets
    model = outer(d=64)
    weight = "transformer.embed.embedding_table"
    size = 100 * 64 * 4
    with pytest.raises(BudgetError, match=rf"'{weight}' needs {size} bytes"):
        plan_units(model, size - 1, 2).check_fits()
    block = nbytes(model.transformer.h[0])
    pair = nbytes(model) - 2 * block                       # root + two of the four blocks
    tight = plan_units(model, pair - 1, 0, no_split=(type(model.transformer.h[0]),))
    with pytest.raises(BudgetError, match=r"units 'transformer\.h\.0' .* and 'transformer\.h\.1'"):
        tight.check_fits()
    plan_units(model, pair, 0, no_split=(type(model.transformer.h[0]),)).check_fits()   # fits exactly


def test_a_compiled_cell_is_never_split_or_searched(ms):
    """@jit: a compiled cell's children run inside its graph, where hooks cannot run."""
    nn = ms.nn

    class CompiledBlock(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Dense(32, 32), nn.Dense(32, 32)

        @ms.jit
        def construct(self, x):
            return self.b(self.a(x))

    class CompiledModel(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([nn.Dense(32, 32) for _ in range(4)])

        @ms.jit
        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = nn.CellList([CompiledBlock() for _ in range(4)])
    block = nbytes(model[0])
    plan = plan_units(model, 3 * block, 2)                 # share = block * 3 / 4: would split
    assert [u.name for u in plan.units] == ["0", "1", "2", "3"]
    everything_root = plan_units(CompiledModel(), 1 << 30, 2)
    assert everything_root.units == [] and len(everything_root.root.params) == 8
