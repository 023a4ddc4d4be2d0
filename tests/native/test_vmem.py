"""Stable addresses: VirtualRange/Home, Arena.attach/detach (mremap page moves), the lazily
faulted arena, the memory-limit check, and the CPU backend's reserve/home/attach/detach/bind.

The core claim: a MindSpore tensor bound once to a Home computes with whatever block's
pages are attached there now, in PyNative and in a @jit function compiled before the swap.
"""
import ctypes
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

n = pytest.importorskip("prefetchd._native")

PAGE = os.sysconf("SC_PAGE_SIZE")


def filled(arena, nbytes, seed):
    """An arena block holding a recognisable byte pattern."""
    block = arena.alloc(nbytes)
    np.frombuffer(block, np.uint8)[:] = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8)
    return block, bytes(memoryview(block))


def vm_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# ---------------------------------------------------------------- VirtualRange / Home

def test_range_is_aligned_page_rounded_and_not_accessible_memory():
    r = n.VirtualRange(5 << 20)
    assert r.address % (2 << 20) == 0 and r.nbytes == 5 << 20
    r2 = n.VirtualRange(10, align=1 << 16)
    assert r2.address % (1 << 16) == 0 and r2.nbytes == PAGE
    home = r.slice(PAGE, 5000)
    assert home.address == r.address + PAGE and home.offset == PAGE
    assert home.nbytes == 5000 and home.capacity == 2 * PAGE and len(memoryview(home)) == 5000
    assert not home.attached and home.block is None


def test_range_and_home_errors_name_the_bad_value():
    r = n.VirtualRange(1 << 20)
    with pytest.raises(ValueError, match="offset 100 is not a multiple of the page size"):
        r.slice(100, 10)
    with pytest.raises(ValueError, match="does not fit in the virtual range of 1048576"):
        r.slice(0, (1 << 20) + 1)
    with pytest.raises(ValueError, match="does not fit"):
        r.slice(1 << 30, 1)
    keep = r.slice(2 * PAGE, PAGE)
    with pytest.raises(ValueError, match=f"overlaps the live home at offset {2 * PAGE}"):
        r.slice(PAGE, 2 * PAGE)
    with pytest.raises(ValueError, match="overlaps"):
        r.slice(2 * PAGE, 1)
    r.slice(3 * PAGE, PAGE)                   # adjacent is fine
    del keep
    r.slice(2 * PAGE, PAGE)                   # a dropped home frees its slot
    with pytest.raises(ValueError, match="power of two"):
        n.VirtualRange(PAGE, align=3 * PAGE)
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        n.VirtualRange(0)
    r.close()
    r.close()
    with pytest.raises(n.Closed):
        r.slice(0, PAGE)


def test_attach_detach_round_trip_keeps_bytes():
    arena = n.Arena(8 << 20)
    r = n.VirtualRange(4 << 20)
    sizes = [5000, PAGE, 3 * PAGE + 1, 1 << 20]
    homes, offset = [], 0
    for size in sizes:
        homes.append(r.slice(offset, size))
        offset += -(-size // PAGE) * PAGE
    blocks = [filled(arena, size, seed) for seed, size in enumerate(sizes)]
    for _ in range(3):
        for home, (block, data) in zip(homes, blocks):
            arena.attach(block, home)
            assert home.attached and home.block.address == block.address and block.attached
            assert bytes(memoryview(home)) == data
            # the block's own range now holds fresh, untouched (zero) pages
            assert not np.frombuffer(block, np.uint8).any()
        for home, (block, data) in zip(homes, blocks):
            arena.detach(home, block)
            assert not home.attached and not block.attached and bytes(memoryview(block)) == data
    assert arena.num_blocks == len(sizes)


def test_writes_at_the_home_land_in_the_block():
    arena = n.Arena(1 << 20)
    home = n.VirtualRange(1 << 20).slice(0, 3 * PAGE)
    block, _ = filled(arena, 3 * PAGE, 1)
    arena.attach(block, home)
    view = np.frombuffer(home, np.uint32)
    view[:] = np.arange(view.size, dtype=np.uint32)
    arena.detach(home, block)
    assert (np.frombuffer(block, np.uint32) == np.arange(view.size)).all()


def test_swapping_blocks_under_one_home():
    arena = n.Arena(1 << 20)
    home = n.VirtualRange(1 << 20).slice(0, 2 * PAGE)
    (a, da), (b, db) = filled(arena, 2 * PAGE, 1), filled(arena, 2 * PAGE, 2)
    view = np.frombuffer(home, np.uint8)      # one view, made once
    arena.attach(a, home)
    assert view.tobytes() == da
    arena.detach(home, a)
    arena.attach(b, home)
    assert view.tobytes() == db
    arena.detach(home, b)
    assert bytes(memoryview(a)) == da and bytes(memoryview(b)) == db


def test_attach_detach_errors_leave_mappings_intact():
    arena = n.Arena(1 << 20)
    r = n.VirtualRange(1 << 20)
    home = r.slice(0, 2 * PAGE)
    small, _ = filled(arena, PAGE, 1)
    with pytest.raises(ValueError, match="cannot back a home of 8192"):
        arena.attach(small, home)
    other = n.Arena(1 << 20).alloc(2 * PAGE)
    with pytest.raises(ValueError, match="does not belong to this arena"):
        arena.attach(other, home)
    block, data = filled(arena, 2 * PAGE, 2)
    arena.attach(block, home)
    with pytest.raises(ValueError, match="already has a block attached"):
        arena.attach(arena.alloc(2 * PAGE), home)
    with pytest.raises(ValueError, match="already attached to another home"):
        arena.attach(block, r.slice(4 * PAGE, 2 * PAGE))
    wrong = arena.alloc(2 * PAGE)
    with pytest.raises(ValueError, match="holds the pages of the block at"):
        arena.detach(home, wrong)
    with pytest.raises(n.NativeError, match="attached to a home"):
        block.release()
    assert bytes(memoryview(home)) == data     # nothing moved by the refused calls
    arena.detach(home, block)
    with pytest.raises(ValueError, match="has no block attached"):
        arena.detach(home, block)
    block.release()
    with pytest.raises(n.Closed):
        arena.attach(block, home)
    sub_page = n.Arena(1 << 20, alignment=512)
    first = sub_page.alloc(512)                # kept: the next block starts 512 bytes in
    with pytest.raises(ValueError, match="not page-aligned"):
        sub_page.attach(sub_page.alloc(2 * PAGE), home)
    assert first.offset == 0
    arena.close()
    with pytest.raises(n.Closed, match="arena is closed"):
        arena.attach(wrong, home)


def test_detach_after_the_arena_is_closed_keeps_bytes():
    arena = n.Arena(1 << 20)
    home = n.VirtualRange(1 << 20).slice(0, 2 * PAGE)
    block, data = filled(arena, 2 * PAGE, 6)
    arena.attach(block, home)
    arena.close()                             # the block keeps the arena's mapping alive
    arena.detach(home, block)
    assert bytes(memoryview(block)) == data and not block.attached
    block.release()


def test_dropping_an_attached_home_returns_its_block():
    arena = n.Arena(1 << 20)
    r = n.VirtualRange(1 << 20)
    home = r.slice(0, PAGE)
    block, _ = filled(arena, PAGE, 3)
    arena.attach(block, home)
    del block
    assert arena.used == PAGE                 # the home keeps its block allocated
    del home
    assert arena.used == 0 and arena.num_blocks == 0


def test_a_view_keeps_the_reservation_mapped():
    arena = n.Arena(1 << 20)
    r = n.VirtualRange(1 << 20)
    home = r.slice(0, PAGE)
    block, data = filled(arena, PAGE, 4)
    arena.attach(block, home)
    view = np.frombuffer(home, np.uint8)
    del home, block
    r.close()
    del r
    assert view.tobytes() == data


def test_moves_a_block_that_spans_several_kernel_mappings():
    """mremap refuses a range that crosses VMAs; attach/detach must split the move."""
    arena = n.Arena(4 << 20)
    block, data = filled(arena, 16 * PAGE, 5)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    MADV_NOHUGEPAGE = 15                      # a flag change splits the arena's VMA mid-block
    assert libc.madvise(block.address + 5 * PAGE, 3 * PAGE, MADV_NOHUGEPAGE) == 0
    home = n.VirtualRange(1 << 20).slice(0, 16 * PAGE)
    arena.attach(block, home)
    assert bytes(memoryview(home)) == data
    arena.detach(home, block)
    assert bytes(memoryview(block)) == data


def test_concurrent_attach_detach_on_many_homes():
    arena = n.Arena(16 << 20)
    r = n.VirtualRange(16 << 20)
    errors = []

    def worker(i):
        try:
            home = r.slice(i * (1 << 20), 1 << 20)
            block, data = filled(arena, 1 << 20, 10 + i)
            for _ in range(50):
                arena.attach(block, home)
                assert bytes(memoryview(home)[:4096]) == data[:4096]
                arena.detach(home, block)
            assert bytes(memoryview(block)) == data
        except BaseException as e:           # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ---------------------------------------------------------------- transparent huge pages

HUGE = 2 << 20


def thp_mode():
    """The kernel's THP setting ("always", "madvise" or "never"), or None without THP."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def thp_fallbacks():
    """Huge-page faults the kernel could not serve (no free 2 MiB run), so far."""
    for line in open("/proc/vmstat"):
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def anon_huge_bytes(address):
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_blocks_start_on_huge_page_boundaries_and_small_ones_fill_the_gap():
    plain, huge = n.Arena(16 << 20), n.Arena(16 << 20, huge_pages=True)
    assert huge.huge_pages and not plain.huge_pages
    for arena in (plain, huge):
        small = arena.alloc(PAGE)
        large = arena.alloc(4 << 20)
        gap = arena.alloc(PAGE)
        if arena is huge:
            assert large.address % HUGE == 0
            assert gap.address == small.address + PAGE      # best fit: the hole before the large block
            assert arena.used == 2 * PAGE + (4 << 20)       # the alignment gap is not charged
        else:
            assert large.address == small.address + PAGE
        for b in (small, large, gap):
            b.release()
        assert arena.used == 0 and arena.largest_free == arena.capacity


def test_a_large_block_that_only_fits_off_a_huge_page_boundary_is_not_refused():
    arena = n.Arena((4 << 20) + 2 * PAGE, huge_pages=True)
    small = arena.alloc(PAGE)
    large = arena.alloc(4 << 20)                          # no 2 MiB-aligned run of 4 MiB is left
    assert large.address == small.address + PAGE


def test_host_pool_huge_page_blocks_are_aligned_and_counted_exactly():
    pool = n.HostPool(16 << 20, huge_pages=True)
    big, odd, small = pool.alloc(4 << 20), pool.alloc((3 << 20) + 100), pool.alloc(100 << 10)
    assert big.address % HUGE == 0 and odd.address % HUGE == 0
    assert pool.used == (4 << 20) + (3 << 20) + 100 + (100 << 10)
    np.frombuffer(odd, np.uint8)[:] = 7
    assert (np.frombuffer(odd, np.uint8) == 7).all()


def test_huge_page_blocks_keep_their_bytes_and_their_huge_pages_through_attach_and_detach():
    if thp_mode() in (None, "never"):
        pytest.skip(f"transparent huge pages are {thp_mode() or 'not built'} on this kernel")
    fallbacks = thp_fallbacks()
    arena = n.Arena(32 << 20, huge_pages=True)
    r = n.VirtualRange(32 << 20)
    sizes = [4 << 20, (6 << 20) + 100]
    homes = [r.slice(0, sizes[0]), r.slice(8 << 20, sizes[1])]
    blocks = [filled(arena, size, 20 + i) for i, size in enumerate(sizes)]
    for _ in range(3):
        for home, (block, data) in zip(homes, blocks):
            arena.attach(block, home)
            assert bytes(memoryview(home)) == data
        huge_at_home = anon_huge_bytes(homes[0].address)
        for home, (block, data) in zip(homes, blocks):
            arena.detach(home, block)
            assert bytes(memoryview(block)) == data
    if thp_fallbacks() > fallbacks:
        pytest.skip("the kernel had no free 2 MiB runs for this test's huge pages")
    # The pages moved as whole huge pages (page-middle-directory moves), not split.
    assert huge_at_home >= 4 << 20


def test_reading_a_detached_home_dies_with_sigsegv():
    script = textwrap.dedent("""
        import numpy as np
        from prefetchd import _native as n
        arena = n.Arena(1 << 20)
        home = n.VirtualRange(1 << 20).slice(0, 4096)
        block = arena.alloc(4096)
        np.frombuffer(block, np.uint8)[:] = 7
        arena.attach(block, home)
        view = np.frombuffer(home, np.uint8)
        print("attached", int(view[0]), flush=True)
        arena.detach(home, block)
        print("read", int(view[0]), flush=True)
    """)
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.splitlines() == ["attached 7"], run.stdout + run.stderr
    assert run.returncode == -11, (run.returncode, run.stderr)
    # It says why before it dies, then Python's faulthandler (installed first) shows where.
    said = run.stderr.index("prefetchd: a managed tensor was read while it was not resident")
    assert said < run.stderr.index("Fatal Python error: Segmentation fault") < run.stderr.index('line 12')


def test_a_fault_outside_the_homes_is_left_to_the_handler_before_ours():
    script = textwrap.dedent("""
        import ctypes
        from prefetchd import _native as n
        r = n.VirtualRange(1 << 20)          # installs the home-fault handler
        print("reading", flush=True)
        ctypes.string_at(8, 1)
    """)
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.splitlines() == ["reading"], run.stdout + run.stderr
    assert run.returncode == -11, (run.returncode, run.stderr)
    assert "prefetchd:" not in run.stderr and "Fatal Python error: Segmentation fault" in run.stderr


def test_a_sigsegv_sent_by_kill_still_ends_the_process():
    script = textwrap.dedent("""
        import os, signal
        from prefetchd import _native as n
        r = n.VirtualRange(1 << 20)          # installs the home-fault handler
        os.kill(os.getpid(), signal.SIGSEGV)
        print("survived", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == -11 and "survived" not in run.stdout, (run.returncode, run.stdout, run.stderr)


# ---------------------------------------------------------------- the arena is lazy

def test_an_8_gib_arena_costs_no_memory_until_used():
    before = vm_rss()
    arena = n.Arena(8 << 30)
    after = vm_rss()
    assert after - before < 32 << 20, f"VmRSS grew {after - before} bytes for an untouched arena"
    block = arena.alloc(64 << 20)
    np.frombuffer(block, np.uint8)[:] = 1
    touched = vm_rss()
    assert touched - after >= 60 << 20        # pages arrive on first write
    home = n.VirtualRange(64 << 20).slice(0, 64 << 20)
    for _ in range(5):                        # moving pages back and forth allocates none
        arena.attach(block, home)
        arena.detach(home, block)
    assert vm_rss() - touched < 16 << 20
    arena.close()


# ---------------------------------------------------------------- MindSpore reads through a fixed home

def test_mindspore_reads_new_weights_through_a_fixed_home_pynative_and_jit():
    ms = pytest.importorskip("mindspore")
    from mindspore import nn, ops

    from prefetchd.backend import framework

    arena = n.Arena(4 << 20)
    rows = cols = 64
    nbytes = rows * cols * 4
    home = n.VirtualRange(1 << 20).slice(0, nbytes)

    def weights(values):
        block = arena.alloc(nbytes)
        np.frombuffer(block, np.float32).reshape(rows, cols)[:] = values
        return block

    w_old = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    w_new = np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32)
    old_block, new_block = weights(w_old), weights(w_new)
    arena.attach(old_block, home)
    view = np.frombuffer(home, np.float32, rows * cols).reshape(rows, cols)
    tensor = ms.Tensor.from_numpy(view)                                 # bound once
    param = ms.Parameter(ms.Tensor(np.zeros((rows, cols), np.float32)), name="w")
    framework.bind(param, view)                                         # bound once

    class Dense(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = param

        @ms.jit
        def construct(self, x):
            return ops.matmul(x, self.w)

    @ms.jit
    def dense(x, w):
        return ops.matmul(x, w)

    cell = Dense()
    x = ms.Tensor(np.random.default_rng(3).standard_normal((4, rows)).astype(np.float32))
    xs = x.asnumpy()

    def outputs():
        return {"pynative tensor": ops.matmul(x, tensor).asnumpy(),
                "pynative param": ops.matmul(x, param).asnumpy(),
                "jit fn": dense(x, tensor).asnumpy(),
                "jit cell param": cell(x).asnumpy()}

    for name, out in outputs().items():                                 # compiles the jit ones
        np.testing.assert_allclose(out, xs @ w_old, rtol=1e-4, atol=1e-4, err_msg=name)
    framework.synchronize()
    arena.detach(home, old_block)
    arena.attach(new_block, home)                                       # other pages, same address
    assert not np.allclose(xs @ w_old, xs @ w_new, atol=1e-2)
    for name, out in outputs().items():
        np.testing.assert_allclose(out, xs @ w_new, rtol=1e-4, atol=1e-4, err_msg=name)
    framework.synchronize()
    arena.detach(home, new_block)


# ---------------------------------------------------------------- memory limit

def test_available_memory_reads_ram_and_cgroup_limits(tmp_path):
    from prefetchd import limits

    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16384000 kB\nSwapTotal: 0 kB\n")
    cg = tmp_path / "cgroup"
    (proc / "self" / "cgroup").write_text("0::/a/b\n")
    got = limits.available_memory(str(proc), str(cg))
    assert got.nbytes == 16384000 * 1024 and "MemTotal" in got.source
    # cgroup v2: the tightest of the process's cgroup and its ancestors
    (cg / "a" / "b").mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("memory\n")
    (cg / "a" / "b" / "memory.max").write_text("max\n")
    (cg / "a" / "memory.max").write_text(f"{3 << 30}\n")
    got = limits.available_memory(str(proc), str(cg))
    assert got.nbytes == 3 << 30 and "memory.max" in got.source and str(cg / "a") in got.source
    # cgroup v1: memory.limit_in_bytes of the memory controller's cgroup
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/\n")
    (cg / "memory" / "job").mkdir(parents=True)
    (cg / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    (cg / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # unlimited
    got = limits.available_memory(str(proc), str(cg))
    assert got.nbytes == 1 << 30 and "memory.limit_in_bytes" in got.source


def test_a_budget_beyond_available_memory_is_refused_with_the_numbers(tmp_path):
    from prefetchd import limits
    from prefetchd.backend import create
    from prefetchd.config import Config
    from prefetchd.errors import ConfigError

    available = limits.available_memory()
    with pytest.raises(ConfigError) as err:
        limits.check_budgets(1000000 << 40, 4 << 30, limits.Available(24 << 30, "a test cgroup (memory.max)"))
    assert str(err.value).startswith("device_budget 1000000 TiB + host_budget 4 GiB")
    assert "exceeds the 24 GiB that a test cgroup (memory.max) allows" in str(err.value)
    config = Config.load(env={}, device_budget=available.nbytes, host_budget=1 << 30,
                         store_dir=str(tmp_path / "store"))
    with pytest.raises(ConfigError, match=r"device_budget .* exceeds the .* allows") as err:
        create(config)
    assert available.source in str(err.value)
    assert not (tmp_path / "store").exists()       # refused before anything was created


# ---------------------------------------------------------------- CPU backend contract

def test_cpu_backend_reserve_home_attach_bind_once(tmp_path):
    ms = pytest.importorskip("mindspore")
    from prefetchd.backend import create
    from prefetchd.config import Config

    be = create(Config.load(env={}, device_budget="8MiB", store_dir=str(tmp_path / "store")))
    try:
        shape, dtype = (32, 16), np.float32
        nbytes = 32 * 16 * 4
        vrange = be.reserve(3 * nbytes)
        assert vrange.address % (2 << 20) == 0
        home = be.home(vrange, 0, nbytes)
        values = [np.full(shape, v, dtype) for v in (1.5, -2.0)]
        blocks = []
        for v in values:
            block = be.alloc_device(nbytes)
            be.view(block, shape, dtype)[:] = v
            blocks.append(block)
        be.attach(home, blocks[0])
        param = ms.Parameter(ms.Tensor(np.zeros(shape, dtype)), name="p")
        be.bind(param, home, shape, dtype)
        assert float(param.sum().asnumpy()) == pytest.approx(1.5 * 512)
        be.compute_fence()
        be.detach(home, blocks[0])
        be.attach(home, blocks[1])
        assert float(param.sum().asnumpy()) == pytest.approx(-2.0 * 512)
        # a Home is a buffer for the store and the copy streams too
        be.write_sync("k", home)
        back = be.alloc_host(nbytes)
        be.read_sync("k", back)
        assert (be.view(back, shape, dtype) == -2.0).all()
        be.start_store("k2", home, nbytes, b"m", tag=7)
        done = be.wait_completions(30)
        assert [(c.tag, c.status) for c in done] == [(7, 0)]
        be.compute_fence()
        be.detach(home, blocks[1])
        for b in blocks:
            be.free_device(b)
        assert be.device_used() == 0
        be.free_host(back)
    finally:
        be.close()


def test_dlpack_capsule_over_a_home_is_a_mindspore_tensor_without_copy():
    """The capsule layout the Ascend backend binds homes with, checked against real MindSpore on CPU."""
    ms = pytest.importorskip("mindspore")
    from mindspore.utils.dlpack import from_dlpack

    from prefetchd.backend import dlpack

    arena = n.Arena(1 << 20)
    home = n.VirtualRange(1 << 20).slice(0, 6 * 4)
    old, new = arena.alloc(24), arena.alloc(24)
    np.frombuffer(old, np.float32)[:] = np.arange(6)
    np.frombuffer(new, np.float32)[:] = -np.arange(6) * 10
    arena.attach(old, home)
    capsule = dlpack.dlpack_capsule(home.address, (2, 3), np.float32, dlpack.KDL_CPU, owner=home)
    assert dlpack.read_capsule(capsule) == (home.address, (2, 3), np.dtype(np.float32), dlpack.KDL_CPU, 0)
    tensor = from_dlpack(capsule)
    assert tensor.shape == (2, 3)
    np.testing.assert_array_equal((tensor * 2).asnumpy(), np.arange(6).reshape(2, 3) * 2)
    ms.hal.synchronize()
    arena.detach(home, old)
    arena.attach(new, home)
    np.testing.assert_array_equal((tensor * 2).asnumpy(), -np.arange(6).reshape(2, 3) * 20)
    ms.hal.synchronize()
    del tensor
    arena.detach(home, new)


def test_cpu_backend_uses_huge_pages_unless_configured_off(tmp_path):
    from prefetchd.backend.cpu import CpuBackend
    from prefetchd.config import Config
    for setting in (True, False):
        config = Config.load(env={"PREFETCHD_HUGE_PAGES": str(setting).lower()}, device_budget="64MiB",
                             host_budget="64MiB", store_dir=str(tmp_path / str(setting)))
        backend = CpuBackend(config)
        try:
            assert backend.device.huge_pages is setting and backend.host.huge_pages is setting
        finally:
            backend.close()


# ---------------------------------------------------------------- read-only pages (memory.h)

def test_clean_pages_travel_read_only_and_change_no_protection():
    arena = n.Arena(1 << 20)
    home = n.VirtualRange(1 << 20).slice(0, 2 * PAGE)
    block, data = filled(arena, 2 * PAGE, 3)
    arena.attach(block, home)                  # a written block: the home is made read-only (one change)
    before = n.protection_changes()
    arena.detach(home, block)                  # clean: the pages leave read-only, nothing changed
    assert bytes(memoryview(block)) == data and memoryview(block).readonly
    with pytest.raises(TypeError):
        memoryview(block)[0] = 1               # a reader's view is read-only: no fault, a refusal
    for _ in range(3):
        arena.attach(block, home)
        assert bytes(memoryview(home)) == data
        arena.detach(home, block)
    other = arena.alloc(2 * PAGE)
    n.move_pages(other, block)                 # the protection moves with the pages
    assert memoryview(other).readonly and bytes(memoryview(other)) == data
    assert n.protection_changes() == before, "a clean round trip changed protections"
    assert not memoryview(block).readonly      # its range holds no pages now: writable again
    np.frombuffer(other, np.uint8)[:4] = 9     # a writer makes the block writable first
    assert n.protection_changes() == before + 1 and not memoryview(other).readonly
    assert bytes(memoryview(other))[:8] == b"\x09" * 4 + data[4:8]


def test_a_written_home_gives_writable_pages_back():
    arena = n.Arena(1 << 20)
    home = n.VirtualRange(1 << 20).slice(0, PAGE)
    block, _ = filled(arena, PAGE, 4)
    arena.attach(block, home)
    arena.detach(home, block)                  # read-only pages now
    arena.attach(block, home)                  # arrive read-only: watched without a change
    assert home.write_watched
    np.frombuffer(home, np.uint8)[0] = 77      # compute writes: faults once, counted
    assert home.take_written()
    np.frombuffer(home, np.uint8)[1] = 78      # and again after the re-arm
    arena.detach(home, block)
    assert not memoryview(block).readonly and bytes(memoryview(block))[:2] == bytes([77, 78])


def test_native_writers_and_a_reused_range_get_writable_pages(tmp_path):
    arena = n.Arena(4 * PAGE)
    home = n.VirtualRange(1 << 20).slice(0, 2 * PAGE)
    block, data = filled(arena, 2 * PAGE, 5)
    arena.attach(block, home)
    arena.detach(home, block)
    assert memoryview(block).readonly
    src = np.arange(2 * PAGE, dtype=np.uint8)
    n.bulk_copy(block, src)                    # a native copy into read-only pages: made writable first
    assert bytes(memoryview(block)) == src.tobytes()
    arena.attach(block, home)
    arena.detach(home, block)                  # read-only again
    address = block.address
    block.release()                            # its range goes back to the arena writable
    again = arena.alloc(2 * PAGE)
    assert again.address == address and not memoryview(again).readonly
    memoryview(again)[:3] = b"abc"
    assert bytes(memoryview(again))[:3] == b"abc"
