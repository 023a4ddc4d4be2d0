"""TensorHandle: what Daemon.register() returns, a name bound to one daemon's record."""


class TensorHandle:
    """What register() returns: a name bound to one daemon."""

    __slots__ = ("name", "_rec", "__weakref__")

    def __init__(self, rec):
        self.name = rec.name
        self._rec = rec

    nbytes = property(lambda self: self._rec.nbytes)
    shape = property(lambda self: self._rec.shape)
    dtype = property(lambda self: self._rec.dtype)
    state = property(lambda self: self._rec.state)
    tiers = property(lambda self: self._rec.tiers)
    target = property(lambda self: self._rec.target)

    def __repr__(self):
        r = self._rec
        return f"<TensorHandle {r.name!r} {r.nbytes} B {r.state.value} tiers={r.tiers}>"
