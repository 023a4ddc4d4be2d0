"""Reply codes <-> exceptions: what the server answers for a daemon error, and
what a client raises for an error reply."""
from ..errors import ConfigError
from ..errors import (BudgetError, PinnedError, PrefetchdError, ShutdownError, StorageError,
                      UnknownTensorError)
from . import protocol as P


class ServiceError(PrefetchdError):
    """A refusal by the server that has no daemon error of its own (BAD_REQUEST, ...)."""

    def __init__(self, message, code=P.INTERNAL):
        super().__init__(message)
        self.code = code


class BusyError(ServiceError):
    """The server has too many requests outstanding; retry later."""


class RequestTimeout(PrefetchdError, TimeoutError):
    """No reply within the call's timeout, or the server gave up waiting (code TIMEOUT)."""

    code = P.TIMEOUT


class ConnectionLost(PrefetchdError, ConnectionError):
    """The connection to the server was lost while the request was outstanding (the server
    closed, died, or dropped the connection): it may or may not have run."""


class BadArguments(ValueError):
    """A request's arguments are unusable; the reply is BAD_REQUEST with this message."""


# Most specific first: the first class an exception is an instance of decides its code.
_ERROR_CODES = (
    (UnknownTensorError, P.UNKNOWN_TENSOR), (BudgetError, P.BUDGET), (PinnedError, P.PINNED),
    (ShutdownError, P.SHUTDOWN), (StorageError, P.STORAGE),
    # OverflowError: a number too large for the daemon's arithmetic is the caller's fault.
    ((ConfigError, ValueError, TypeError, OverflowError), P.BAD_REQUEST),
    (TimeoutError, P.TIMEOUT),
)
_CODE_TO_ERROR = {
    P.UNKNOWN_TENSOR: UnknownTensorError, P.BUDGET: BudgetError, P.PINNED: PinnedError,
    P.SHUTDOWN: ShutdownError, P.STORAGE: StorageError, P.BUSY: BusyError,
    P.TIMEOUT: RequestTimeout,
}


def error_code(exc):
    """The reply code of an exception raised while serving a request."""
    for classes, code in _ERROR_CODES:
        if isinstance(exc, classes):
            return code
    return P.INTERNAL


def exception_for(code, reason):
    """The exception a Client raises for an error reply."""
    cls = _CODE_TO_ERROR.get(code)
    if cls is None:
        return ServiceError(f"{code}: {reason}", code)
    if issubclass(cls, ServiceError):
        return cls(reason, code)
    exc = cls(reason)
    exc.code = code
    return exc
