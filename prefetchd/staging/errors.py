"""The one exception staging raises."""
from ..errors import PrefetchdError


class StagingError(PrefetchdError, ValueError):
    """A checkpoint or store that cannot be staged or read back.

    The message is one line naming the file (or store entry) and the field at
    fault, e.g. "model.ckpt: tensor 'w': dims[1] is -3 (negative)".
    """


# The name this error had before staging grew a package; kept for callers.
CheckpointError = StagingError
