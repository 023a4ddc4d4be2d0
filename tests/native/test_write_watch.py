"""Write watches on attached homes (native/include/home_faults.h).

An attached home is read-only; its first write faults, the handler makes it
writable and counts the write, and `Home.take_written()` tells the daemon, so
a tensor that compute wrote in place is written back instead of dropped as
clean. What must hold: no write is missed, even one racing take_written from
another thread; a watched write never kills the process, even with another
SIGSEGV handler installed over ours; a detached home and its block behave as
before (reads of the home die, the block takes the next load's bytes).
"""
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

n = pytest.importorskip("prefetchd._native")

PAGE = 4096


def attached(nbytes=4 * PAGE, fill=7):
    arena = n.Arena(1 << 22)
    home = n.VirtualRange(1 << 22).slice(0, nbytes)
    block = arena.alloc(nbytes)
    np.frombuffer(block, np.uint8)[:] = fill
    arena.attach(block, home)
    return arena, home, block


def test_an_attached_home_reports_each_write_once_and_keeps_it():
    arena, home, block = attached()
    view = np.frombuffer(home, np.uint8)
    assert home.write_watched
    assert int(view.sum()) == 7 * view.size and home.take_written() is False   # reads are not writes
    view[5] = 9
    assert home.take_written() is True
    assert home.take_written() is False          # re-armed: nothing written since
    view[3 * PAGE + 1] = 1                       # another page of the same home
    assert home.take_written() is True
    arena.detach(home, block)
    got = np.frombuffer(block, np.uint8)
    assert got[5] == 9 and got[3 * PAGE + 1] == 1 and got[0] == 7


def test_a_detached_home_reports_nothing_and_its_block_takes_writes_again():
    arena, home, block = attached()
    np.frombuffer(home, np.uint8)[0] = 1
    arena.detach(home, block)
    assert home.take_written() is False and not home.write_watched
    np.frombuffer(block, np.uint8)[:] = 3        # the next load fills the block: it must be writable
    arena.attach(block, home)
    assert home.take_written() is False          # a fresh attach starts clean
    assert int(np.frombuffer(home, np.uint8)[0]) == 3


def test_a_home_dropped_while_attached_unwatches_it():
    arena, home, block = attached()
    del home                                      # the block goes back to the arena
    _, home2, _ = attached()
    np.frombuffer(home2, np.uint8)[0] = 2
    assert home2.take_written() is True


def test_a_write_in_every_round_is_seen_by_the_next_take():
    arena, home, block = attached()
    view = np.frombuffer(home, np.uint32)
    wrote, taken = threading.Event(), threading.Event()
    rounds = 500

    def writer():
        for k in range(rounds):
            view[k % view.size] = k + 1
            wrote.set()
            assert taken.wait(30)
            taken.clear()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    for k in range(rounds):
        assert wrote.wait(30), k
        wrote.clear()
        assert home.take_written() is True, f"round {k}: the write was missed"
        assert home.take_written() is False, f"round {k}: nothing was written since"
        taken.set()
    t.join(30)


def test_writes_racing_take_written_are_never_lost():
    """A writer thread never stops while the main thread takes: after the writer
    ends, some take since its last write must have said True."""
    arena, home, block = attached(nbytes=16 * PAGE)
    view = np.frombuffer(home, np.uint64)
    stop = threading.Event()
    last_write = [0]

    def writer():
        k = 0
        while not stop.is_set():
            k += 1
            view[(k * 977) % view.size] = k
            last_write[0] = k

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    trues = 0
    for _ in range(20000):
        trues += home.take_written()
    stop.set()
    t.join(30)
    assert trues > 0
    # Every write before the writer stopped is visible now, and one more take says so
    # unless the last take already covered the last write.
    home.take_written()
    assert home.take_written() is False
    arena.detach(home, block)
    # Every slot holds the last value written to it, the others their fill. (Not the
    # maximum: slot 0 is first written at k = 8192, which a slow writer never reaches.)
    want = np.full(view.size, 0x0707070707070707, np.uint64)
    ks = np.arange(1, last_write[0] + 1, dtype=np.uint64)
    want[(ks * 977) % view.size] = ks
    np.testing.assert_array_equal(np.frombuffer(block, np.uint64), want)


def run_python(script):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120)


def test_a_watched_write_survives_a_handler_installed_over_ours_and_a_stray_read_still_dies():
    run = run_python("""
        import faulthandler
        import numpy as np
        from prefetchd import _native as n
        arena = n.Arena(1 << 20)
        home = n.VirtualRange(1 << 20).slice(0, 4096)   # installs our handler
        faulthandler.enable()                           # installed over ours
        block = arena.alloc(4096)
        arena.attach(block, home)                       # puts ours back on top
        view = np.frombuffer(home, np.uint8)
        view[0] = 5
        print("wrote", int(view[0]), home.take_written(), flush=True)
        arena.detach(home, block)
        print("read", int(view[0]), flush=True)
    """)
    assert run.stdout.splitlines() == ["wrote 5 True"], run.stdout + run.stderr
    assert run.returncode == -11, (run.returncode, run.stderr)
    said = run.stderr.index("prefetchd: a managed tensor was read while it was not resident")
    assert said < run.stderr.index("Fatal Python error: Segmentation fault")


def test_a_write_to_a_detached_home_dies_saying_so():
    run = run_python("""
        import numpy as np
        from prefetchd import _native as n
        arena = n.Arena(1 << 20)
        home = n.VirtualRange(1 << 20).slice(0, 4096)
        block = arena.alloc(4096)
        arena.attach(block, home)
        view = np.frombuffer(home, np.uint8)
        arena.detach(home, block)
        print("writing", flush=True)
        view[0] = 1
        print("survived", flush=True)
    """)
    assert run.stdout.splitlines() == ["writing"], run.stdout + run.stderr
    assert run.returncode == -11 and "prefetchd: a managed tensor was read while it was not resident" \
        in run.stderr, (run.returncode, run.stderr)
