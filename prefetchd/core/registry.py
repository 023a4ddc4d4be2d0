"""The registry: name -> record, and framework tensor -> name (one tensor, one name).

Readers on any thread hold the daemon's lock; records are added by the
registering thread and removed only when a registration fails.

A framework tensor is managed by one daemon at a time in the whole process: a
second daemon binding it to its own memory left the first one pinning and
reading an address the second had unmapped (SIGSEGV). `_OWNERS` maps each
managed tensor to its daemon's registry until it is unregistered or that
daemon has closed.
"""
import threading

from .. import _native
from ..errors import DoubleRegisterError, UnknownTensorError
from .records import ManagedTensor, RecordIndex

# The longest tensor name the remote tier can store (its key limit).
MAX_NAME_BYTES = _native.MAX_KEY_BYTES


def check_name(name):
    """A usable tensor name, or ValueError/TypeError saying why not."""
    if name is None:
        raise ValueError("a tensor needs a name: pass name=, or register a Parameter (it has one)")
    if not isinstance(name, str):
        raise TypeError(f"a tensor name must be a str, not {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("a tensor name must not be empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"tensor name {name!r} cannot be encoded as UTF-8 ({e.reason})") from None
    if len(encoded) > MAX_NAME_BYTES:
        raise ValueError(f"tensor name {name[:40]!r}... is {len(encoded)} bytes; "
                         f"the store allows at most {MAX_NAME_BYTES}")
    if "\0" in name:
        raise ValueError(f"tensor name {name!r} contains a NUL character")
    return name


_OWNERS = {}                   # id(framework tensor) -> the Registry managing it (it holds the tensor)
_OWNERS_LOCK = threading.Lock()


def managing_daemon(tensor):
    """The name of the live daemon that manages `tensor`, or None."""
    with _OWNERS_LOCK:
        owner = _OWNERS.get(id(tensor))
    return None if owner is None else owner.daemon_name


class Registry:
    def __init__(self, daemon_name):
        self.daemon_name = daemon_name
        self.records = {}          # name -> ManagedTensor
        self._targets = {}         # id(framework tensor) -> name
        self.index = RecordIndex()   # pinned, host-only and droppable host records, kept by the records

    def refuse_taken(self, name, target):
        """DoubleRegisterError if `name` or the framework tensor `target` is registered here.
        Asked before a registration reads the tensor, too: one registered and not resident
        refused the read (NotResidentError) instead of saying it is registered."""
        if name in self.records:
            raise DoubleRegisterError(
                f"a tensor named {name!r} is already registered (names are unique in one daemon: a "
                f"second model whose parameters have the same names needs its own daemon, or a prefix, "
                f"e.g. model.update_parameters_name('second.'))")
        if target is not None and id(target) in self._targets:
            raise DoubleRegisterError(f"this tensor is already registered as {self._targets[id(target)]!r}")

    def add(self, rec):
        self.refuse_taken(rec.name, rec.target)
        if rec.target is not None:
            with _OWNERS_LOCK:           # looked at and claimed in one step: two daemons may race
                other = _OWNERS.get(id(rec.target))
                if other is not None and other is not self:
                    raise DoubleRegisterError(
                        f"this tensor is managed by prefetchd daemon {other.daemon_name!r}: a tensor is "
                        f"managed by one daemon at a time (unregister it there, or close that daemon, first)")
                _OWNERS[id(rec.target)] = self
            self._targets[id(rec.target)] = rec.name
        self.records[rec.name] = rec
        rec.index = self.index
        self.index.update(rec)

    def forget(self, rec):
        self.index.discard(rec)
        rec.index = None
        self.records.pop(rec.name, None)
        if rec.target is not None:
            self._targets.pop(id(rec.target), None)
            self._disown(rec.target)

    def release_targets(self):
        """The daemon has closed: its tensors may be managed by another daemon from now on."""
        for rec in self.records.values():
            if rec.target is not None:
                self._disown(rec.target)

    def _disown(self, target):
        with _OWNERS_LOCK:
            if _OWNERS.get(id(target)) is self:
                del _OWNERS[id(target)]

    @property
    def pinned(self):
        """The registered records with pins > 0."""
        return self.index.pinned

    @property
    def host_only(self):
        """The registered records with a host replica and no remote one."""
        return self.index.host_only

    @property
    def droppable_host(self):
        """The registered records whose host replica the host cache may drop now (RecordIndex)."""
        return self.index.droppable_host

    def _own(self, rec):
        """rec if this registry holds it: a handle of another daemon's tensor (another copy of
        the same model, names alike) would move that daemon's memory through this one's store."""
        if rec.index is not self.index:
            raise UnknownTensorError(
                f"tensor {rec.name!r} is not registered with daemon {self.daemon_name!r}: its handle "
                f"belongs to another daemon, or the tensor was unregistered (or dropped)")
        return rec

    def name_of(self, tensor):
        """The name a framework tensor is registered under, or None."""
        return self._targets.get(id(tensor))

    def record(self, item, is_tensor):
        """The record for a handle, record, name or registered framework tensor."""
        rec = getattr(item, "_rec", None)
        if isinstance(rec, ManagedTensor):
            return self._own(rec)
        if isinstance(item, ManagedTensor):
            return self._own(item)
        if isinstance(item, str):
            rec = self.records.get(item)
            if rec is None:
                raise UnknownTensorError(
                    f"no tensor named {item!r} is registered with daemon {self.daemon_name!r}")
            return rec
        name = self._targets.get(id(item)) if is_tensor(item) else None
        if name is None:
            raise UnknownTensorError(
                f"{type(item).__name__} is not registered with daemon {self.daemon_name!r}")
        return self.records[name]

    def records_of(self, tensors, is_tensor):
        """Records for one tensor-like item or an iterable of them, without duplicates."""
        rec = getattr(tensors, "_rec", None)       # a TensorHandle: the hot path of prefetch hits
        if rec is not None:
            return (self._own(rec),)
        if isinstance(tensors, (str, ManagedTensor)) or is_tensor(tensors):
            tensors = (tensors,)
        try:
            items = tuple(tensors)
        except TypeError:
            raise TypeError(f"expected a tensor, a name, a handle or an iterable of them; "
                            f"got {type(tensors).__name__}") from None
        recs = tuple(self.record(t, is_tensor) for t in items)
        if len({id(r) for r in recs}) != len(recs):
            recs = tuple({id(r): r for r in recs}.values())
        return recs

    def __iter__(self):
        return iter(self.records.values())

    def __len__(self):
        return len(self.records)
