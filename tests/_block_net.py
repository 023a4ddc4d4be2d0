"""A small model of our own for the host-cache and reload tests: BLOCKS residual Dense blocks
in a CellList, each block's weight and bias one unit (UNIT_BLOCKS bytes with its page)."""
from mindspore import nn

HIDDEN, BLOCKS = 128, 8
WEIGHT = HIDDEN * HIDDEN * 4
UNIT_BLOCKS = WEIGHT + 4096          # a block's weight, and its bias in one 4 KiB page


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(HIDDEN, HIDDEN)
        self.act = nn.ReLU()

    def construct(self, x):
        return x + self.act(self.fc(x))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([Block() for _ in range(BLOCKS)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x
