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
    """A request that cannot fit the device tier: too large, or what holds the tier cannot give
    way to it (pinned tensors; for a prefetch, also tensors prefetched and not used yet)."""


class PinnedError(PrefetchdError):
    """An attempt to evict or move a tensor that compute is using."""


class ShutdownError(PrefetchdError):
    """A request submitted to a daemon that is closing or closed."""


class SchedulerWaitError(PrefetchdError):
    """A wait for a request that only the scheduler thread can finish, made on that thread
    (a future's callback or a listener): it would wait forever."""


class StorageError(PrefetchdError):
    """The remote tier failed to read or write (I/O error, disk full, ...)."""


class FlushError(StorageError):
    """A flush some of whose write-backs failed, raised once every write-back it covered has
    settled: `.failures` maps each failed tensor's name to its error (a StorageError)."""

    def __init__(self, failures):
        self.failures = dict(failures)
        items = list(self.failures.items())
        if len(items) == 1:
            message = str(items[0][1])
        else:
            shown = "; ".join(f"{name!r}: {error}" for name, error in items[:5])
            more = f"; and {len(items) - 5} more" if len(items) > 5 else ""
            message = f"{len(items)} write-backs failed: {shown}{more}"
        super().__init__(message)


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


class DaemonClosedError(NotResidentError):
    """A managed tensor used after the daemon managing it closed: its values are gone from it."""


class UseAfterFreeError(NotResidentError):
    """A tensor used after prefetchd.ops.free() or detach() released its device memory."""


class DuplicateKey(ValueError):
    """A key given twice in one JSON object (unique_keys); `key` is the key."""

    def __init__(self, key):
        super().__init__(f"the key {key[:64]!r} is given twice")
        self.key = key


def unique_keys(pairs):
    """json object_pairs_hook: a dict, refusing a key given twice (DuplicateKey), where json
    kept the last without a word. For JSON a client or a file hands us: a request body, a
    safetensors header, a sharding spec, a shared host tier message. Linear: finding the
    key with keys.count() took 51 s for a 650 KB body of 60,000 keys, the last one twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj
