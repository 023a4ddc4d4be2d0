"""The scheduler core: residency state, device memory and the scheduler thread.

Modules, by role (imports point down this list, never up):

    session    what the layer hooks use per unit (acquire / release / trace)
    binding    compute-thread side: framework tensors <-> device replicas, user writes
    scheduler  the scheduler thread: request and completion handler tables, shutdown
    loads      residency moves in: ABSENT -> LOADING -> RESIDENT, as start/done halves
    writeback  residency moves out: write-back, verify, drop
    explicit   evict and flush requests, settled as their write-backs land
    placement  register(tier="host" | "remote"): new tensors placed off the device, or forgotten
    hostcache  host RAM as a cache of the remote tier
    memory     device memory: watermarks, reservations, victims, compute fences
    fences     the thread that sleeps on the compute-fence word
    homes      the stable address each tensor keeps for life
    transfers  transfers in flight, by tag
    requests   submitted requests and how their futures are settled
    events     residency events for listeners
    registry   name -> record, framework tensor -> name
    policy     eviction order (LRU, Belady on recorded traces)
    records    one tensor's replicas and its named states

The core never imports the control plane, the metrics exporter, staging or
the hooks: the facade in prefetchd/daemon.py composes them.
"""
