"""A tensor-parallel transformer streamed by prefetchd, one daemon per rank, under msrun.

Copy and adapt (docs/distributed.md). Each rank holds 1/N of every attention and MLP
projection: wq/wk/wv and fc1 are column-parallel (rank r holds rows r*out/N..(r+1)*out/N,
so its heads and its slice of the hidden MLP width), wo and fc2 are row-parallel (rank r
holds the matching input columns; partial sums meet in an AllReduce over
mindspore.communication, then the replicated bias is added once). Embeddings, norms and
the head are replicated. The weights come from a sharded store that

    prefetchd stage full.ckpt --store STORE --shard "$(python tp_transformer.py --print-spec)" --ranks 2

wrote (STORE/rank_0, STORE/rank_1); every rank streams its own shard through a Daemon
whose device budget is a fraction of that shard.

    python tp_transformer.py --make-checkpoint full.ckpt             # a seeded full model
    msrun --worker_num 2 --local_worker_num 2 --master_port 8118 --join True --log_dir logs \\
        tp_transformer.py --store STORE --report out/
    ... tp_transformer.py --store STORE --bench --full-checkpoint full.ckpt   # streamed vs resident
    ... tp_transformer.py --resident --full-checkpoint full.ckpt               # the resident baseline
    python tp_transformer.py --reference full.ckpt --report out/     # one process, whole model

Every rank writes out/rank_<N>.json (its rank, status, peak, bytes read, timings) and
out/rank_<N>.npy (its last output: the same on every rank after the final AllReduce).
"""
import argparse
import fnmatch
import json
import os
import signal
import sys
import threading
import time
import zlib

import numpy as np

# Column-parallel weights (and their biases) split along the output axis 0, row-parallel
# weights along the input axis 1; whatever no glob names is replicated.
SHARDING = {"*.wq.weight": 0, "*.wq.bias": 0, "*.wk.weight": 0, "*.wk.bias": 0,
            "*.wv.weight": 0, "*.wv.bias": 0, "*.wo.dense.weight": 1,
            "*.fc1.weight": 0, "*.fc1.bias": 0, "*.fc2.dense.weight": 1}


def spec_text():
    return ",".join(f"{glob}={axis}" for glob, axis in SHARDING.items())


def build(args, world, init_weights=True):
    """The model for a world of `world` ranks (1: the whole model). Built lazily from MindSpore so
    `--print-spec` needs no MindSpore import."""
    from mindspore import Parameter, nn, ops

    hidden, heads, ffn = args.hidden, args.heads, 4 * args.hidden
    if heads % world or ffn % world:
        raise SystemExit(f"tp_transformer: {heads} heads / MLP width {ffn} do not divide into {world} ranks")
    reduce = ops.AllReduce() if world > 1 else (lambda x: x)

    class RowParallelDense(nn.Cell):
        """y = AllReduce(x_r W_r^T) + b: each rank's partial product over its input columns."""

        def __init__(self, d_in, d_out):
            super().__init__()
            self.dense = nn.Dense(d_in // world, d_out, has_bias=False)
            self.bias = Parameter(np.zeros(d_out, np.float32), name="bias")

        def construct(self, x):
            return reduce(self.dense(x)) + self.bias

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.local_heads, self.dh = heads // world, hidden // heads
            self.norm1, self.norm2 = nn.LayerNorm((hidden,)), nn.LayerNorm((hidden,))
            self.wq, self.wk, self.wv = (nn.Dense(hidden, hidden // world) for _ in range(3))
            self.wo = RowParallelDense(hidden, hidden)
            self.fc1 = nn.Dense(hidden, ffn // world)
            self.fc2 = RowParallelDense(ffn, hidden)
            self.act = nn.GELU()
            self.softmax = nn.Softmax(-1)

        def construct(self, x):
            b, s, _ = x.shape
            h = self.norm1(x)
            q, k, v = (ops.transpose(d(h).reshape(b, s, self.local_heads, self.dh), (0, 2, 1, 3))
                       for d in (self.wq, self.wk, self.wv))
            att = self.softmax(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / float(np.sqrt(self.dh)))
            ctx = ops.transpose(ops.matmul(att, v), (0, 2, 1, 3)).reshape(b, s, hidden // world)
            x = x + self.wo(ctx)
            return x + self.fc2(self.act(self.fc1(self.norm2(x))))

    class TPTransformer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(args.vocab, hidden)
            self.blocks = nn.CellList([Block() for _ in range(args.layers)])
            self.norm = nn.LayerNorm((hidden,))
            self.head = nn.Dense(hidden, args.vocab)

        def construct(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    if init_weights:
        return TPTransformer()
    from mindspore.nn.utils import no_init_parameters
    with no_init_parameters():          # no weights in RAM: they stream from the rank's store
        return TPTransformer()


def shard_of(array, name, rank, world):
    """Rank `rank`'s slice of a whole-model tensor, by SHARDING (what `stage --shard` cuts)."""
    for glob, axis in SHARDING.items():
        if fnmatch.fnmatchcase(name, glob):
            return np.ascontiguousarray(np.split(array, world, axis=axis)[rank])
    return array


def load_resident(args, rank, world):
    """The resident sharded baseline: rank's slices of the full checkpoint, in RAM."""
    import mindspore as ms
    model = build(args, world)
    full = ms.load_checkpoint(args.full_checkpoint)
    params = {n: ms.Parameter(ms.Tensor(shard_of(p.asnumpy(), n, rank, world)), name=n) for n, p in full.items()}
    missing, _ = ms.load_param_into_net(model, params, strict_load=True)
    if missing:
        raise SystemExit(f"tp_transformer: {args.full_checkpoint} lacks {missing[0]}")
    return model


def make_checkpoint(args):
    import mindspore as ms
    model = build(args, 1)
    for p in model.get_parameters():         # seeded per name: the same file from any process
        p.set_data(ms.Tensor(np.random.default_rng(zlib.crc32(p.name.encode()) ^ args.seed)
                             .normal(0, 0.05, p.shape).astype(np.float32)))
    ms.save_checkpoint(model, args.make_checkpoint)
    print(json.dumps({"checkpoint": args.make_checkpoint, "spec": spec_text(),
                      "bytes": sum(int(np.prod(p.shape)) * 4 for p in model.get_parameters())}))


def tokens(args):
    import mindspore as ms
    rng = np.random.default_rng(args.seed + 1)
    return ms.Tensor(rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32))


def reference(args):
    """The single-process resident whole model's output on the same input."""
    import mindspore as ms
    ms.set_device("CPU")
    args.full_checkpoint = args.reference
    model = load_resident(args, 0, 1)
    out = model(tokens(args)).asnumpy()
    os.makedirs(args.report, exist_ok=True)
    np.save(os.path.join(args.report, "reference.npy"), out)
    for name in sorted(os.listdir(args.report)):      # the ranks' outputs, if they ran already
        if name.startswith("rank_") and name.endswith(".npy"):
            got = np.load(os.path.join(args.report, name))
            # The AllReduce sums partial products in another order: equal within float error.
            print(f"{name}: max |rank - reference| = {float(np.max(np.abs(got - out))):.3g}, "
                  f"allclose(atol=1e-5): {bool(np.allclose(got, out, atol=1e-5))}")


def timed_passes(model, x, n, progress=None, kill=None):
    """n passes; each pass's start (and a failure, with its time) is a line in `progress`, so a
    rank that dies or hangs mid-run leaves a record of where."""
    times, out = [], None
    for i in range(n):
        _note(progress, {"pass": i, "start": time.time()})
        if kill is not None and i == kill:
            os.kill(os.getpid(), signal.SIGKILL)      # a rank dying mid-run (the test's fault)
        t = time.perf_counter()
        try:
            out = model(x).asnumpy()
        except BaseException as e:              # e.g. an AllReduce whose peer died: say when, then give up
            _note(progress, {"pass": i, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                             "t": time.time()})
            raise
        times.append(time.perf_counter() - t)
    return times, out


def _note(progress, doc):
    if progress is not None:
        progress.write(json.dumps(doc) + "\n")
        progress.flush()


def run_rank(args):
    import mindspore as ms
    from mindspore.communication import init

    import prefetchd
    from prefetchd.ranks import detect, rank_config

    ms.set_device("CPU")
    init()
    info = detect()
    rank, world = info.rank, info.world_size
    x = tokens(args)
    report = {"rank": rank, "world_size": world, "local_rank": info.local_rank, "source": info.source,
              "pid": os.getpid()}
    os.makedirs(args.report, exist_ok=True)
    progress = open(os.path.join(args.report, f"rank_{rank}.progress"), "w")
    _note(progress, {"pid": os.getpid(), "rank": rank})
    kill = args.kill_after if args.kill_rank == rank else None
    if args.resident:
        t, out = timed_passes(load_resident(args, rank, world), x, args.passes, progress, kill)
        report["resident_pass_seconds"] = t
        return _write(args, report, out)

    model = build(args, world, init_weights=False)
    shard = report["shard_bytes"] = sum(int(np.prod(p.shape)) * 4 for p in model.get_parameters())
    config = rank_config(prefetchd.Config.load(store_dir=args.store, device_budget=max(1, int(shard * args.budget)),
                                               endpoint=args.endpoint, trace=args.trace))
    baseline = load_resident(args, rank, world) if args.bench else None
    try:
        _stream(args, report, model, x, baseline, config, progress, kill)
    finally:
        _note(progress, {"closed": time.time()})    # the daemon is closed: what is left is exit


def _stream(args, report, model, x, baseline, config, progress, kill):
    import prefetchd
    from prefetchd.telemetry.metrics import render
    rank = config.rank
    with prefetchd.Daemon(config) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=args.lookahead, checkpoint=True)
        if baseline is None:
            t, out = timed_passes(model, x, args.passes, progress, kill)
            report["streamed_pass_seconds"] = t
        else:                                   # interleaved: the same machine state for both
            streamed, resident = [], []
            for _ in range(args.passes):
                s, out = timed_passes(model, x, 1)
                r, ref = timed_passes(baseline, x, 1)
                streamed += s
                resident += r
            report.update(streamed_pass_seconds=streamed, resident_pass_seconds=resident,
                          equal_to_resident=bool(np.array_equal(out, ref)))
        status = daemon.status()
        # The recorded unit order (the same on every rank: the same program) and its misses.
        report.update(trace=[str(step) for step in handle.trace], handle_stats=handle.stats())
        report.update(status=status, config_name=config.name, store=config.store_dir,
                      metrics_rank_samples=sum(f'rank="{rank}"' in line for line in render(daemon).splitlines()
                                               if line.startswith("prefetchd_")),
                      threads=[(t.name, t.daemon) for t in threading.enumerate()])
        if args.endpoint:
            import subprocess
            cli = subprocess.run([sys.executable, "-m", "prefetchd.cli", "status", "--endpoint", config.endpoint],
                                 capture_output=True, text=True, timeout=60)
            report["status_cli"] = cli.stdout + cli.stderr
    _write(args, report, out)


def _write(args, report, out):
    np.save(os.path.join(args.report, f"rank_{report['rank']}.npy"), out)
    with open(os.path.join(args.report, f"rank_{report['rank']}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    for key in ("streamed_pass_seconds", "resident_pass_seconds"):
        if key in report:
            print(f"rank {report['rank']}: {key} median {np.median(report[key][1:] or report[key]):.4f}",
                  flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.25, help="device budget, a fraction of the rank's shard")
    p.add_argument("--lookahead", type=int, default=1)
    p.add_argument("--store", help="the sharded store `prefetchd stage --shard` wrote")
    p.add_argument("--endpoint", help="control endpoint (each rank serves it with .rank<N>)")
    p.add_argument("--trace", help="timeline file (each rank writes its own .rank<N>)")
    p.add_argument("--report", default="tp-report", help="directory for rank_<N>.json/.npy")
    p.add_argument("--full-checkpoint", help="the whole model's checkpoint (--resident, --bench)")
    p.add_argument("--resident", action="store_true", help="run the resident sharded model instead")
    p.add_argument("--bench", action="store_true", help="streamed and resident passes, interleaved")
    p.add_argument("--kill-rank", type=int, help="this rank SIGKILLs itself at pass --kill-after")
    p.add_argument("--kill-after", type=int, default=1)
    p.add_argument("--make-checkpoint", metavar="PATH", help="write a seeded whole model and exit")
    p.add_argument("--reference", metavar="CKPT", help="run the whole model in this one process")
    p.add_argument("--print-spec", action="store_true", help="print the --shard spec and exit")
    args = p.parse_args(argv)
    if args.print_spec:
        print(spec_text())
    elif args.make_checkpoint:
        make_checkpoint(args)
    elif args.reference:
        reference(args)
    else:
        if (args.resident or args.bench) and not args.full_checkpoint:
            p.error("--resident and --bench need --full-checkpoint")
        if not args.resident and not args.store:
            p.error("streaming needs --store (a sharded store)")
        run_rank(args)


if __name__ == "__main__":
    main()
