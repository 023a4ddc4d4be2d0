"""Dynamic batching in the front: a queue per model; requests with the same
batch key (prefetchd.serve.admission) are joined along the batch axis up to
`max_batch_size` rows and sent to one worker as one batch, which runs one
forward (one weight stream) for all of them and splits the outputs back.

A model's batch is ready when its oldest request's compatible requests fill
`max_batch_size` rows, or when that request has waited `max_delay` seconds
(Triton's max_queue_delay). `max_batch_size` 1 turns batching off. A request
larger than `max_batch_size` runs alone. Used on the front's I/O thread only.
"""
import collections
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


class Batcher:
    def __init__(self, max_batch_size=8, max_delay=0.002):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self._queues = collections.OrderedDict()     # model -> deque of Jobs

    def __len__(self):
        return sum(len(q) for q in self._queues.values())

    def add(self, job):
        self._queues.setdefault(job.model, collections.deque()).append(job)

    def remove(self, job):
        q = self._queues.get(job.model)
        if q is not None and job in q:
            q.remove(job)
            return True
        return False

    def abandon(self, identity):
        """Drop the queued jobs of the client whose routing identity is `identity` (a reply to
        it found it gone: nobody will take theirs); returns how many, now done."""
        gone = [j for q in self._queues.values() for j in q if j.envelope[0] == identity]
        for job in gone:
            self.remove(job)
            job.finish()
        return len(gone)

    def drain(self):
        jobs = [j for q in self._queues.values() for j in q]
        self._queues.clear()
        return jobs

    def _compatible(self, q):
        """The jobs joined with q's head: same key, in order, up to max_batch_size rows."""
        head = q[0]
        chosen, rows = [head], head.rows
        if head.key is None:
            return chosen, rows
        for job in list(q)[1:]:
            if rows >= self.max_batch_size:
                break
            if job.key == head.key and rows + job.rows <= self.max_batch_size:
                chosen.append(job)
                rows += job.rows
        return chosen, rows

    def ready_models(self, now):
        """Models with a batch ready to send, oldest head first."""
        ready = []
        for model, q in self._queues.items():
            if not q:
                continue
            _, rows = self._compatible(q)
            if rows >= self.max_batch_size or now >= q[0].received + self.max_delay:
                ready.append((q[0].received, model))
        return [m for _, m in sorted(ready)]

    def take(self, model):
        """Pop and return the jobs of `model`'s next batch."""
        q = self._queues[model]
        chosen, _ = self._compatible(q)
        for job in chosen:
            q.remove(job)
        return chosen

    def next_wakeup(self):
        """When the oldest waiting head's delay runs out (None: nothing waits)."""
        return min((q[0].received + self.max_delay for q in self._queues.values() if q),
                   default=None)
