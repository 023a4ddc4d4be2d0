"""ManagedTensor: one tensor's replicas on the three tiers and its device-replica state.

    ABSENT -> LOADING -> RESIDENT(clean|dirty) -> STORING -> RESIDENT(clean) -> ABSENT

Only the scheduler thread changes these records (the compute thread may set
`dirty` and read `state`); the daemon's lock guards them for readers.

Besides `state`, a record carries a few flags that qualify it; the
combinations that matter have names (`describe()["substate"]`):

    RESIDENT + writeback_failed     held in place: its only copy could not be written
    RESIDENT + prefetched_unused    loaded ahead of use, not used yet (not a victim for prefetches)
    LOADING  + evict_after_load     an evict arrived while loading: dropped on arrival
    STORING  + evict_after_store    a write-back on the way to an eviction
"""
import enum
import heapq
import itertools
from dataclasses import dataclass, field

from ..errors import PrefetchdError


class State(str, enum.Enum):
    ABSENT = "absent"
    LOADING = "loading"
    RESIDENT = "resident"
    STORING = "storing"


@dataclass(eq=False)
class ManagedTensor:
    name: str
    shape: tuple
    dtype: object            # numpy dtype
    nbytes: int
    target: object = None    # the framework Tensor/Parameter bound to the device replica
    state: State = State.ABSENT
    block: object = None     # device replica (backend block) while LOADING/RESIDENT/STORING
    home: object = None      # stable address the framework tensor views for life (None: rebinding backend)
    host_block: object = None  # host replica, valid when host_valid
    host_valid: bool = False
    remote_valid: bool = False
    keeps_store_file: bool = False   # its store file was there before it (register_remote: a staged
                                     # store): forgetting the tensor leaves the file
    dirty: bool = False      # device replica newer than every lower replica
    pins: int = 0            # compute or requests hold it: never evicted or moved while > 0
    last_use: int = 0
    bound_address: int = 0   # block address the framework tensor currently views (0: none)
    exposed: bool = False    # compute may have read the device block since it was bound
    waiters: list = field(default_factory=list)   # (request) waiting for RESIDENT
    error: BaseException | None = None           # last failure of a load/store of this tensor
    generation: int = 0      # bumped on every write by the user (dirty marking)
    store_generation: int = 0  # generation being written back
    initial: object = None   # register(): the values to place, until placed
    requested: bool = False  # a prefetch was submitted and the scheduler has not taken it yet
    prefetched_unused: bool = False  # loaded ahead of use and not used yet
    reading_host: bool = False   # a load is copying from the host replica (do not drop it)
    host_lent: bool = False  # the host block's pages are under the home (moved, not copied;
                             # core/lending.py): the host block holds none of the bytes until they return
    host_parked: bool = False  # not resident, its host-tier pages left under the home, PROT_NONE
                               # (core/lending.py): the host block holds none until unparked
    mapping_parked: bool = False  # not resident, its shared-tier mapping left under the home,
                                  # PROT_NONE, its lease held (core/lending.py)
    guard_unpinned: bool = False  # an offloaded model's weight: Python-level use refused whenever
                                  # nothing pins it, resident or not (hooks/registration.py)
    writeback_failed: bool = False   # last write-back failed: keep in place, do not pick as victim
    evict_after_store: str | None = None  # eviction reason waiting for the write-back
    evict_after_load: bool = False
    compute_epoch: int | None = None  # compute-fence epoch covering every read of the block (None: unknown)
    index: object = field(default=None, repr=False)   # the registry's RecordIndex, once registered

    @property
    def tiers(self):
        """Where valid replicas are, fastest first."""
        out = []
        if self.state in (State.RESIDENT, State.STORING):
            out.append("device")
        if self.host_valid:
            out.append("host")
        if self.remote_valid:
            out.append("remote")
        return out

    @property
    def host_cached(self):
        """A host replica kept as a cache of the remote tier (droppable: the remote copy is the truth)."""
        return self.host_valid and self.remote_valid

    @property
    def replica(self):
        """The buffer holding the device replica's bytes: the home once attached, else the block."""
        return self.home if self.home is not None else self.block

    @property
    def substate(self):
        if self.state is State.RESIDENT and self.writeback_failed:
            return "held"
        if self.state is State.RESIDENT and self.prefetched_unused:
            return "prefetched"
        if self.state is State.LOADING and self.evict_after_load:
            return "loading-then-evict"
        if self.state is State.STORING and self.evict_after_store:
            return "evicting"
        return self.state.value

    def describe(self):
        return {
            "name": self.name, "nbytes": self.nbytes, "shape": list(self.shape),
            "dtype": str(self.dtype), "state": self.state.value, "tiers": self.tiers,
            "dirty": self.dirty, "pins": self.pins, "substate": self.substate,
        }

    def __deepcopy__(self, memo):
        # What reaches a record (copy.deepcopy of an offloaded model reaches its hooks) would
        # copy the daemon's memory: "cannot pickle 'prefetchd._native.Block'" said nothing useful.
        raise PrefetchdError(f"prefetchd's record of {self.name!r} cannot be copied: {NOT_COPYABLE}")

    def __reduce_ex__(self, protocol):
        raise PrefetchdError(f"prefetchd's record of {self.name!r} cannot be pickled: {NOT_COPYABLE}")


NOT_COPYABLE = ("an offloaded model cannot be copied or pickled (prefetchd's hooks on it hold the daemon's "
                "memory): copy it before prefetchd.offload(), or build another and give it these weights "
                "with prefetchd.load_param_into_net")


class RecordIndex:
    """The records in the states the scheduler asks about on every load, kept up to date
    as the records change (the fields in INDEXED assign through it), so that asking
    costs O(records in that state), not O(tensors): with thousands of tensors a scan
    per load made a pass quadratic.

        pinned      pins > 0: the device memory's pinned bytes (every reservation)
        host_only   a host replica and no remote one: room the host cache cannot use
                    (every admission)
        droppable_host  a valid host replica of a tensor whose remote copy is valid too,
                    no load reading it: what the host cache may drop now (every admission
                    that needs room). A dict in the order they became droppable, so that
                    victims the policy ranks equal come out in the same order every run;
                    by_last_use() walks them least recently used first.
    """

    def __init__(self):
        self.pinned = set()
        self.host_only = set()
        self.droppable_host = {}   # rec -> (seq, last_use) of its entry in _by_use
        self._by_use = []          # heap of (last_use, seq, rec); an entry is live while it
        self._seq = itertools.count()   # is the one droppable_host names (else stale, skipped)

    def update(self, rec):
        _place(self.pinned, rec, rec.pins > 0)
        _place(self.host_only, rec, rec.host_block is not None and not rec.remote_valid)
        if rec.host_block is not None and rec.host_valid and rec.remote_valid and not rec.reading_host:
            if rec in self.droppable_host:
                self.used(rec)           # already indexed: at most its last use moved
            else:
                self._push(rec)
        else:
            self.droppable_host.pop(rec, None)

    def used(self, rec):
        """rec.last_use moved (every prefetch hit): only its place in by_last_use can change."""
        entry = self.droppable_host.get(rec)
        if entry is not None and entry[1] != rec.last_use:
            self._push(rec)

    def discard(self, rec):
        self.pinned.discard(rec)
        self.host_only.discard(rec)
        self.droppable_host.pop(rec, None)

    def by_last_use(self):
        """The droppable host replicas, least recently used first (ties: the order they were
        indexed), lazily: O(log n) each, not a sort of all of them. The caller may drop the
        ones it takes meanwhile; the rest stay indexed as they were."""
        taken, seen = [], set()
        try:
            while self._by_use:
                entry = heapq.heappop(self._by_use)
                last_use, seq, rec = entry
                if self.droppable_host.get(rec, (None,))[0] != seq or rec in seen:
                    continue   # stale (dropped, used again, re-indexed), or a rebuild's copy
                taken.append(entry)
                seen.add(rec)
                yield rec
        finally:
            for entry in taken:                   # a dropped one's entry is stale from now on
                heapq.heappush(self._by_use, entry)

    def _push(self, rec):
        seq = next(self._seq)
        self.droppable_host[rec] = (seq, rec.last_use)   # its older entry is stale now
        heapq.heappush(self._by_use, (rec.last_use, seq, rec))
        if len(self._by_use) > 2 * len(self.droppable_host) + 64:    # mostly stale: rebuild
            self._by_use = [(last_use, seq, r) for r, (seq, last_use) in self.droppable_host.items()]
            heapq.heapify(self._by_use)


def _place(members, rec, member):
    if member:
        members.add(rec)
    else:
        members.discard(rec)


class _Indexed:
    """A ManagedTensor field that keeps its record's RecordIndex current on assignment.
    It has no __get__: a read finds the value in the instance's __dict__, as for any
    other field, so only writes pay for the index (the scheduler reads these fields in
    its scans far more often than it writes them)."""

    def __init__(self, on_change):
        self.on_change = on_change   # the RecordIndex method told of a new value: fn(index, rec)

    def __set_name__(self, owner, name):
        self.name = name

    def __set__(self, rec, value):
        rec.__dict__[self.name] = value
        index = rec.__dict__.get("index")
        if index is not None:
            self.on_change(index, rec)


INDEXED = {"pins": RecordIndex.update, "host_block": RecordIndex.update, "host_valid": RecordIndex.update,
           "remote_valid": RecordIndex.update, "reading_host": RecordIndex.update,
           "last_use": RecordIndex.used}   # every prefetch hit moves last_use: the narrow method
for _name, _on_change in INDEXED.items():
    _field = _Indexed(_on_change)
    _field.__set_name__(ManagedTensor, _name)
    setattr(ManagedTensor, _name, _field)
