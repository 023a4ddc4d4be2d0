"""Dynamic batching in the front: a queue per model; requests with the same
batch key (prefetchd.serve.admission) are joined along the batch axis up to
`max_batch_size` rows and sent to one worker as one batch, which runs one
forward (one weight stream) for all of them and splits the outputs back.

A model's batch is ready when its next request's compatible requests fill
`max_batch_size` rows, or when its oldest request has waited `max_delay` seconds
(Triton's max_queue_delay). `max_batch_size` 1 turns batching off. A request
larger than `max_batch_size` runs alone. Used on the front's I/O thread only.

Batches take requests round-robin over the clients (connections) that have some
queued, the one served least recently first, each client's own in order: one
client that queues a thousand requests delays another's next one by a batch, not
by a thousand (first come, first served let a flood starve every other client).
"""
import collections
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Job:
    """One client request, from the moment the front accepts it until it is answered."""
    envelope: list
    rid: bytes
    model: str
    kind: str                    # "infer" or "generate"
    inputs: list                 # the request's tensor headers (checked)
    frames: list                 # its tensor frames (zmq.Frame, not copied)
    rows: int
    key: object                  # batch key; None: never joined
    hint: bool
    deadline: float
    received: float
    max_new_tokens: int | None = None
    fd: int = -1                 # the descriptor of the client's connection (zmq.SRCFD)
    batch: object = None         # the Batch that carries it, once sent
    done: bool = False           # answered (reply, error or timeout)

    def finish(self):
        """Mark it answered and let go of its input frames and its batch: the deadline heap
        keeps an answered job until its deadline, and job and batch refer to each other,
        so its inputs (up to the request size limit) lived until a full gc ran."""
        self.done, self.frames, self.batch = True, [], None


@dataclass(eq=False)
class Batch:
    job_id: bytes
    model: str
    jobs: list
    worker: object
    sent: float
    hinted: bool = False
    rows: int = field(init=False)

    def __post_init__(self):
        self.rows = sum(j.rows for j in self.jobs)

    def body(self):
        first = self.jobs[0]
        doc = {"model": self.model, "kind": first.kind,
               "parts": [{"inputs": j.inputs, "deadline": j.deadline} for j in self.jobs]}
        if first.kind == "generate":
            doc["max_new_tokens"] = first.max_new_tokens
        return doc

    def frames(self):
        return [f for j in self.jobs for f in j.frames]

    def pending(self):
        return [j for j in self.jobs if not j.done]


class ModelQueue:
    """One model's queued jobs: a deque per client (its connection's routing identity),
    each in arrival order; clients in the order they came (again) to have jobs queued."""

    def __init__(self):
        self.clients = {}          # identity -> deque of Jobs
        self._count = 0

    def __len__(self):
        return self._count

    def __iter__(self):
        return (job for jobs in self.clients.values() for job in jobs)

    def add(self, job, first=False):
        jobs = self.clients.setdefault(job.envelope[0], collections.deque())
        if first:
            jobs.appendleft(job)
        else:
            jobs.append(job)
        self._count += 1

    def remove(self, job):
        jobs = self.clients.get(job.envelope[0])
        if jobs is None or job not in jobs:
            return False
        jobs.remove(job)
        self._count -= 1
        if not jobs:
            del self.clients[job.envelope[0]]
        return True

    def oldest(self):
        """When the job that has waited longest arrived."""
        return min(jobs[0].received for jobs in self.clients.values())

    def fair(self, served):
        """The jobs in the order batches take them: round-robin over the clients, the one
        whose job a batch took least recently first (`served`: identity -> when; ties: the
        first to come), each client's in order."""
        order = sorted(self.clients.items(), key=lambda item: served.get(item[0], -1))
        turns = collections.deque(iter(jobs) for _, jobs in order)
        while turns:
            jobs = turns.popleft()
            job = next(jobs, None)
            if job is not None:
                yield job
                turns.append(jobs)


class Batcher:
    def __init__(self, max_batch_size=8, max_delay=0.002):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self._queues = collections.OrderedDict()     # model -> ModelQueue
        self._served = {}                            # client identity -> when a batch last took one
        self._turns = itertools.count()

    def __len__(self):
        return sum(len(q) for q in self._queues.values())

    def add(self, job, first=False):
        """Queue `job` (first: ahead of its client's others, e.g. put back when its batch
        could not go)."""
        self._queues.setdefault(job.model, ModelQueue()).add(job, first)

    def remove(self, job):
        q = self._queues.get(job.model)
        return q is not None and q.remove(job)

    def full_for(self, identity, max_queue):
        """Whether a request of the client `identity` is refused BUSY: the queue holds
        `max_queue`, and this client has some of them queued already or the reserve beyond it
        (max_queue // 8, for clients with none) is taken too. One client's burst filled the
        queue and every other client was BUSY until it drained."""
        queued = len(self)
        if queued < max_queue:
            return False
        mine = any(identity in q.clients for q in self._queues.values())
        return mine or queued >= max_queue + max_queue // 8

    def abandon(self, identity):
        """Drop the queued jobs of the client whose routing identity is `identity` (a reply to
        it found it gone: nobody will take theirs); returns how many, now done."""
        gone = [j for q in self._queues.values() for j in q.clients.get(identity, ())]
        for job in gone:
            self.remove(job)
            job.finish()
        return len(gone)

    def drain(self):
        jobs = [j for q in self._queues.values() for j in q]
        self._queues.clear()
        return jobs

    def _compatible(self, q, parts_for=None):
        """The jobs joined with q's next one: same key, in fair order, up to max_batch_size rows
        and `parts_for(kind)` jobs (None: no limit but the rows)."""
        order = q.fair(self._served)
        head = next(order)
        chosen, rows = [head], head.rows
        if head.key is None:
            return chosen, rows
        most = parts_for(head.kind) if parts_for is not None else None
        for job in order:
            if rows >= self.max_batch_size or (most is not None and len(chosen) >= most):
                break
            if job.key == head.key and rows + job.rows <= self.max_batch_size:
                chosen.append(job)
                rows += job.rows
        return chosen, rows

    def ready_models(self, now):
        """Models with a batch ready to send, in the clients' round-robin across models: first
        the one whose next batch's head client was served least recently, then the one whose
        oldest job waited longest. By age alone a client's thousand queued requests for one
        model went before another's single request for another (queued later), which waited
        for the whole queue (an outside probe: 10 s behind 400, TIMEOUT behind 1200)."""
        ready = []
        for model, q in self._queues.items():
            if not q:
                continue
            chosen, rows = self._compatible(q)
            oldest = q.oldest()
            if rows >= self.max_batch_size or now >= oldest + self.max_delay:
                ready.append((self._served.get(chosen[0].envelope[0], -1), oldest, model))
        return [m for _, _, m in sorted(ready, key=lambda r: r[:2])]

    def take(self, model, parts_for=None):
        """Pop and return the jobs of `model`'s next batch (at most `parts_for(kind)` of them,
        when given: the worker it goes to runs them one after another)."""
        q = self._queues[model]
        chosen, _ = self._compatible(q, parts_for)
        for job in chosen:
            q.remove(job)
            self._served[job.envelope[0]] = next(self._turns)
        if len(self._served) > 2 * len(self) + 64:   # only clients with jobs queued matter
            queued = {c for q in self._queues.values() for c in q.clients}
            self._served = {c: t for c, t in self._served.items() if c in queued}
        return chosen

    def next_wakeup(self):
        """When the oldest waiting job's delay runs out (None: nothing waits)."""
        return min((q.oldest() + self.max_delay for q in self._queues.values() if q), default=None)
