"""One input of a served model: its shape (None for any size), dtype, batch axis and,
for integer ids, their bound; and how the entries a factory may give become one."""
import dataclasses
from dataclasses import dataclass

import numpy as np

from ..config import ConfigError
from ..control.codes import BadArguments
from .wire import DTYPES, MAX_RANK


@dataclass(frozen=True)
class TensorSpec:
    """One input: `shape` with None for any size (the batch axis's entry is ignored),
    the dtype name, the batch axis (None: not batchable), and for integer ids the
    bound `high` (values must be in [0, high))."""
    shape: tuple
    dtype: str
    batch_axis: int | None = 0
    name: str = ""
    high: int | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"input {self.name or '?'}: dtype {self.dtype!r} is not one of "
                              f"{', '.join(DTYPES)}")
        if len(self.shape) > MAX_RANK or not all(d is None or (isinstance(d, int) and d >= 0)
                                                 for d in self.shape):
            raise ConfigError(f"input {self.name or '?'}: shape {self.shape!r} must be at most "
                              f"{MAX_RANK} sizes or None")
        if self.batch_axis is not None and not 0 <= self.batch_axis < len(self.shape):
            raise ConfigError(f"input {self.name or '?'}: batch axis {self.batch_axis} is not "
                              f"an axis of shape {self.shape!r}")

    def to_json(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc):
        return cls(**dict(doc, shape=tuple(doc["shape"])))

    def check(self, index, dtype, shape):
        """BadArguments naming input `index` if (dtype, shape) does not fit this spec."""
        name = f"input {index}" + (f" ({self.name})" if self.name else "")
        if dtype.name != self.dtype:
            raise BadArguments(f"{name}: dtype {dtype.name}, the model takes {self.dtype}")
        if len(shape) != len(self.shape):
            raise BadArguments(f"{name}: rank {len(shape)} (shape {list(shape)}), the model "
                               f"takes rank {len(self.shape)} ({self._shape_text()})")
        for axis, (got, want) in enumerate(zip(shape, self.shape)):
            if axis != self.batch_axis and want is not None and got != want:
                raise BadArguments(f"{name}: dimension {axis} is {got}, the model takes "
                                   f"{self._shape_text()}")
            if axis != self.batch_axis and want is None and got == 0:
                # (it passed here and the model's kernels failed on it: INTERNAL, with
                # MindSpore's C++ call stack as the reason)
                raise BadArguments(f"{name}: dimension {axis} is 0 (an empty input), the model "
                                   f"takes {self._shape_text()} with each size at least 1")
        if self.batch_axis is not None and shape[self.batch_axis] == 0:
            raise BadArguments(f"{name}: an empty batch (dimension {self.batch_axis} is 0)")

    def check_values(self, index, array):
        if self.high is None or not array.size:
            return
        lo, hi = int(array.min()), int(array.max())
        if lo < 0 or hi >= self.high:
            raise BadArguments(f"input {index}" + (f" ({self.name})" if self.name else "")
                               + f": ids must be in [0, {self.high}), got {lo}..{hi}")

    def _shape_text(self):
        dims = ["batch" if a == self.batch_axis else ("*" if d is None else str(d))
                for a, d in enumerate(self.shape)]
        return f"[{', '.join(dims)}]"


def as_tensor_spec(entry, index):
    """A TensorSpec from a signature entry (see the module docstring)."""
    if isinstance(entry, TensorSpec):
        return entry
    if isinstance(entry, dict):
        return TensorSpec(**dict(entry, shape=tuple(entry["shape"])))
    if isinstance(entry, (tuple, list)) and len(entry) in (2, 3):
        shape = (None,) + tuple(entry[0])[1:]
        return TensorSpec(shape, str(np.dtype(entry[1])), 0, f"x{index}",
                          entry[2] if len(entry) == 3 else None)
    raise ConfigError(f"input {index}: {entry!r} is not a TensorSpec, a dict or (shape, dtype)")
