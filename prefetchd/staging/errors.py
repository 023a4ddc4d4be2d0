"""The one exception staging raises (defined with the others in prefetchd.errors)."""
from ..errors import StagingError


# The name this error had before staging grew a package; kept for callers.
CheckpointError = StagingError
