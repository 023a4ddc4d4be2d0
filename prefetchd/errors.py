"""Exceptions raised by prefetchd. Every refusal says what was refused and why."""


class PrefetchdError(RuntimeError):
    """Base class of every prefetchd error."""


class UnknownTensorError(PrefetchdError, KeyError):
    """A name or handle that the daemon does not manage."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DoubleRegisterError(PrefetchdError):
    """A name registered twice, or one tensor registered under two names."""


class BudgetError(PrefetchdError):
    """A request that can never fit the device tier (too large, or everything pinned)."""


class PinnedError(PrefetchdError):
    """An attempt to evict or move a tensor that compute is using."""


class ShutdownError(PrefetchdError):
    """A request submitted to a daemon that is closing or closed."""


class StorageError(PrefetchdError):
    """The remote tier failed to read or write (I/O error, disk full, ...)."""


class IntegrityError(StorageError):
    """Data read back from the remote tier failed its checksum."""


class ConfigError(PrefetchdError, ValueError):
    """A configuration value that cannot be used; the message names the key."""


class StagingError(PrefetchdError, ValueError):
    """A checkpoint or store that cannot be staged or read back.

    The message is one line naming the file (or store entry) and the field at
    fault, e.g. "model.ckpt: tensor 'w': dims[1] is -3 (negative)".
    """


class NotResidentError(PrefetchdError):
    """Compute needed a tensor that is not on the device tier."""

    def __init__(self, name, tier, state, message=None):
        self.name, self.tier, self.state = name, tier, state
        super().__init__(message or (
            f"tensor {name!r} is not resident on the device tier "
            f"(valid replicas: {tier or 'none'}; state: {state})"))


class UseAfterFreeError(NotResidentError):
    """A tensor used after prefetchd.ops.free() or detach() released its device memory."""
