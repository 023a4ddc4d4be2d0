"""A process forked while a Daemon runs (a DataLoader worker, multiprocessing's 'fork'
start method) copies the daemon but not its scheduler thread: each call that waits for
it (handle.close(), flush().result(), prefetch().result(), use of a weight not resident)
waited for good in the child. The child's copy now refuses at once, saying why; the
parent goes on. Real fork of a child process that runs an offloaded model."""
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import mindspore as ms
    import prefetchd
    ms.set_device("CPU")
    ms.set_seed(1)
    model = ms.nn.SequentialCell([ms.nn.Dense(64, 64) for _ in range(6)])
    x = ms.Tensor(np.ones((2, 64), np.float32))
    want = model(x).asnumpy()
    daemon = prefetchd.Daemon(device_budget=3 * 64 * 65 * 4 + (1 << 14), store_dir=sys.argv[1]).start()
    other = prefetchd.Daemon(device_budget="1MiB", store_dir=sys.argv[1] + "-other").start()
    handle = prefetchd.offload(model, daemon, lookahead=1)
    model(x)
    absent = next(w for w in model.get_parameters() if prefetchd.tier(w)[:1] != ("device",))
    pid = os.fork()
    if pid == 0:
        for what, call in [("flush", lambda: daemon.flush().result(5)),
                           ("other.flush", lambda: other.flush().result(5)),
                           ("prefetch", lambda: daemon.prefetch([absent]).result(5)),
                           ("use", lambda: daemon.use([absent]).__enter__()),
                           ("status", daemon.status),
                           ("handle.close", handle.close),
                           ("daemon.close", daemon.close)]:
            started = time.monotonic()
            try:
                call()
                print(what, "ok", flush=True)
            except Exception as e:
                print(what, type(e).__name__, f"{time.monotonic() - started:.1f}s", str(e)[:80], flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child status", status, flush=True)
    assert np.array_equal(model(x).asnumpy(), want)
    handle.close()
    daemon.close()
    other.close()
    print("parent ok", flush=True)
""")


def test_a_forked_child_gets_a_refusal_not_a_hang_and_the_parent_goes_on(tmp_path):
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr[-3000:])
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    refusal = "ShutdownError 0.0s prefetchd daemon 'default' belongs to process "
    for what in ("flush", "prefetch", "use"):
        assert lines.get(what, "").startswith(refusal), run.stdout
    # the hook failed on its first daemon ('cannot create _thread.lock instances'), leaving the
    # second running in the child: its flush waited until the timeout
    assert lines.get("other.flush", "").startswith(refusal), run.stdout
    assert "Exception ignored" not in run.stderr, run.stderr[-2000:]
    for what in ("status", "handle.close", "daemon.close"):     # (returning, not waiting)
        assert lines.get(what) == "ok", run.stdout
    assert lines["child"] == "status 0" and lines["parent"] == "ok", run.stdout


BUSY_PARENT = textwrap.dedent("""
    import os, signal, sys, threading, time
    import numpy as np
    import mindspore as ms
    import prefetchd
    ms.set_device("CPU")
    model = ms.nn.SequentialCell([ms.nn.Dense(64, 64) for _ in range(6)])
    x = ms.Tensor(np.ones((2, 64), np.float32))
    daemon = prefetchd.Daemon(device_budget=3 * 64 * 65 * 4 + (1 << 14), store_dir=sys.argv[1]).start()
    handle = prefetchd.offload(model, daemon, lookahead=1)
    model(x)
    names = daemon.names()

    def busy():        # a thread inside daemon calls (its locks) at any moment
        while True:
            daemon.status()
            daemon.evict(names[-2:])
    threading.Thread(target=busy, daemon=True).start()
    time.sleep(0.2)
    for i in range(6):
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)           # a hang: killed, and the parent sees the signal
            try:
                model(x)
                print("forward ran", flush=True)
            except prefetchd.ShutdownError as e:
                print("refused", str(e)[:60], flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child", i, "status", status, flush=True)
    os._exit(0)
""")


def test_a_forward_in_a_child_forked_while_another_thread_was_in_a_daemon_call_is_refused(tmp_path):
    """The child's copy of a lock another thread held at the fork stays held: the forward took
    the daemon core's lock before anything looked at the fork and waited for good (an outside
    probe: 10 of 10 children). It is refused before any lock now."""
    run = subprocess.run([sys.executable, "-c", BUSY_PARENT, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, (run.stdout, run.stderr[-3000:])
    lines = run.stdout.splitlines()
    assert [line for line in lines if line.startswith("child")] == [f"child {i} status 0" for i in range(6)], \
        run.stdout
    refused = [line for line in lines if line.startswith("refused prefetchd daemon 'default' belongs to process ")]
    assert len(refused) == 6, run.stdout
