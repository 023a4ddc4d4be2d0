"""The store's reads and writes work with the process's descriptor table full: a FileStore
holds a few spare descriptors (native/include/fd_reserve.h) and gives one back when an
open fails with EMFILE. Before, a connection flood that filled the table (the control
plane accepts faster than it drops) failed every store read and write with EMFILE.
Runs in a child: it lowers RLIMIT_NOFILE and fills the table."""
import subprocess
import sys
import textwrap

from helpers import ENV

CHILD = textwrap.dedent("""
    import os, resource, sys
    import numpy as np
    from prefetchd import _native
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
    store = _native.FileStore(sys.argv[1])
    src = _native.aligned_buffer(1 << 16)
    np.frombuffer(src, np.uint8)[:] = 7
    hogs = []
    while True:                                  # what a flood of accepted connections does
        try:
            hogs.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            break
    full = len(hogs)
    results = []
    for i in range(20):                          # more than the spares: each is given back
        store.write_sync(f"k{i}", src)
        dst = _native.aligned_buffer(1 << 16)
        store.read_sync(f"k{i}", dst, True)
        results.append(int(np.frombuffer(dst, np.uint8).sum()))
    print("ok", full, len(set(results)), results[0])
    for fd in hogs:
        os.close(fd)
    store.close()
""")


def test_store_reads_and_writes_with_the_descriptor_table_full(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    word, hogs, distinct, total = out.stdout.split()
    assert word == "ok" and int(hogs) > 50, out.stdout
    assert (distinct, total) == ("1", str(7 << 16)), out.stdout
