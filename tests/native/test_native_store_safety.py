"""prefetchd._native.FileStore safety: the directory lock, recovery that never hangs and
quarantines instead of deleting, the last good version kept until the new one is verified."""
import os
import signal
import struct
import subprocess
import sys
import textwrap

import pytest

n = pytest.importorskip("prefetchd._native")
from _store_helpers import ENV, REPO, data_offset, flip_byte, read_key, write_and_close

pytestmark = pytest.mark.usefixtures("native_faults")     # no injected fault outlives a test


# ---------------------------------------------------------------- the directory lock

HOLDER = textwrap.dedent("""
    import sys
    from prefetchd import _native as n
    s = n.FileStore(sys.argv[1], engine="threads")
    s.write_sync("held", b"x" * 100)
    print("ready", flush=True)
    sys.stdin.readline()
    s.close()
""")


def start_holder(d):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=ENV, cwd=REPO)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_second_process_is_refused_with_the_owner_pid(tmp_path):
    d = str(tmp_path / "store")
    holder = start_holder(d)
    try:
        with pytest.raises(n.StoreInUse, match=rf"^store {d} is in use by pid {holder.pid}$") as ei:
            n.FileStore(d)
        assert isinstance(ei.value, n.IOFailure) and ei.value.pid == holder.pid
        with open(os.path.join(d, ".pfd-lock")) as f:
            assert f.read().strip() == str(holder.pid)
        assert sorted(f for f in os.listdir(d) if f.endswith(".pfd")) != []   # the holder's data untouched
    finally:
        holder.communicate("\n", timeout=30)
    s = n.FileStore(d)   # released at close
    try:
        assert s.contains("held")
    finally:
        s.close()


def test_lock_is_released_when_the_owner_is_killed(tmp_path):
    d = str(tmp_path / "store")
    holder = start_holder(d)
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)
    s = n.FileStore(d)   # the kernel dropped the flock with the process
    try:
        assert s.contains("held")
    finally:
        s.close()


def test_second_open_in_the_same_process_is_refused(tmp_path):
    """Documented choice: one FileStore per directory, in this process as in any other."""
    d = str(tmp_path)
    s = n.FileStore(d)
    try:
        with pytest.raises(n.StoreInUse, match=rf"in use by pid {os.getpid()} \(this process"):
            n.FileStore(d)
        s.write_sync("k", b"still mine")   # the refused open touched nothing
        out = bytearray(10)
        s.read_sync("k", out)
        assert out == b"still mine"
    finally:
        s.close()
    n.FileStore(d).close()


def test_hard_linked_lock_file_does_not_share_the_lock(tmp_path):
    """A staging copy hard-links every file of a store into a new directory; the
    copy must not be 'in use' because the original is open."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    n.FileStore(a).close()
    os.mkdir(b)
    os.link(os.path.join(a, ".pfd-lock"), os.path.join(b, ".pfd-lock"))
    sa = n.FileStore(a)
    try:
        sb = n.FileStore(b)
        sb.write_sync("k", b"1")
        sb.close()
        assert os.stat(os.path.join(b, ".pfd-lock")).st_ino != os.stat(os.path.join(a, ".pfd-lock")).st_ino
        with pytest.raises(n.StoreInUse):
            n.FileStore(a)
    finally:
        sa.close()


# ---------------------------------------------------------------- recovery: never block, quarantine

OPEN_AND_REPORT = textwrap.dedent("""
    import json, sys
    from prefetchd import _native as n
    s = n.FileStore(sys.argv[1])
    print(json.dumps({"keys": s.keys(), "quarantined": s.quarantined}))
    s.close()
""")


def open_in_child(d, timeout=60):
    """Open the store in a child process so a hang fails the test instead of hanging it."""
    import json
    r = subprocess.run([sys.executable, "-c", OPEN_AND_REPORT, d], capture_output=True, text=True, env=ENV,
                       cwd=REPO, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_fifo_symlink_and_directory_named_pfd_are_quarantined_without_blocking(tmp_path):
    d = str(tmp_path / "store")
    s = n.FileStore(d)
    s.write_sync("good", b"g" * 5000)
    good = s.info("good")["path"]
    s.close()
    outside = str(tmp_path / "outside.pfd")
    with open(good, "rb") as f, open(outside, "wb") as g:
        g.write(f.read())
    fifo = os.path.join(d, "fifo-0.0000000000000070.pfd")
    os.mkfifo(fifo)
    link = os.path.join(d, "link-0.0000000000000071.pfd")
    os.symlink(outside, link)
    subdir = os.path.join(d, "dir-0.0000000000000072.pfd")
    os.mkdir(subdir)
    rep = open_in_child(d)                    # used to hang forever on the FIFO
    assert rep["keys"] == ["good"]
    reasons = {q["path"]: q["reason"] for q in rep["quarantined"]}
    assert reasons == {fifo: "not a regular file (fifo)", link: "not a regular file (symlink)",
                       subdir: "not a regular file (directory)"}
    for q in rep["quarantined"]:
        assert q["moved_to"] == os.path.join(d, "quarantine", os.path.basename(q["path"]))
        assert os.path.lexists(q["moved_to"]) and not os.path.lexists(q["path"])
    assert os.path.isfile(outside)            # a symlink is moved, never followed
    s = n.FileStore(d)
    try:
        assert s.quarantined == [] and s.keys() == ["good"]   # quarantine/ itself is left alone
        s.write_sync("next", b"n")
    finally:
        s.close()


READ_REPLACED = textwrap.dedent("""
    import os, sys
    from prefetchd import _native as n
    s = n.FileStore(sys.argv[1], direct=sys.argv[3] == "direct")   # (O_DIRECT refuses a FIFO: EINVAL)
    s.write_sync("k", b"v" * 5000)
    path = s.info("k")["path"]
    os.unlink(path)
    if sys.argv[2] == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(sys.argv[1] + "/elsewhere", path)
    try:
        s.read_sync("k", n.aligned_buffer(8192), True)
    except n.NativeError as e:
        print(type(e).__name__, e)
    print(sorted(s.keys()), s.bytes_stored())    # the store answers others meanwhile
    s.close()
""")


@pytest.mark.parametrize("kind, io, words", [("fifo", "buffered", "is no longer a regular file"),
                                            ("fifo", "direct", "open: EINVAL"),
                                            ("symlink", "buffered", "open: ELOOP")])
def test_a_store_file_replaced_by_a_fifo_or_a_link_while_open_fails_the_read_at_once(tmp_path, kind, io, words):
    # The read's open of a FIFO (under the store's lock) waited for a writer forever: the
    # forward hung, and status(), asking the store its size, froze the process with it.
    r = subprocess.run([sys.executable, "-c", READ_REPLACED, str(tmp_path / "s"), kind, io], capture_output=True,
                       text=True, env=ENV, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first.startswith("IOFailure") and words in first, first
    assert second.startswith("['k']"), second


@pytest.mark.parametrize("damage, reason", [
    ("newer_format", "format version 2 is newer than this build reads (1)"),
    ("extra_bytes", "size 12288 does not match its header (8192)"),
    ("header_bitflip", "header checksum mismatch"),
])
def test_unreadable_files_are_quarantined_with_the_reason(tmp_path, damage, reason):
    d = str(tmp_path)
    path = write_and_close(d, "k", b"v" * 4000)
    if damage == "newer_format":
        with open(path, "r+b") as f:
            f.seek(4)
            f.write((2).to_bytes(4, "little"))
    elif damage == "extra_bytes":
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)
    else:
        flip_byte(path, 60)                   # inside the key bytes
    with open(path, "rb") as f:
        before = f.read()
    s = n.FileStore(d)
    try:
        assert not s.contains("k")
        [q] = s.quarantined
        assert q["path"] == path and q["reason"] == reason
        with open(q["moved_to"], "rb") as f:
            assert f.read() == before           # kept for inspection, unchanged
    finally:
        s.close()


def test_quarantine_never_overwrites_an_earlier_quarantined_file(tmp_path):
    d = str(tmp_path)
    moved = []
    for i in range(2):
        path = write_and_close(d, "k", b"x" * 100)
        flip_byte(path, 60)
        os.rename(path, os.path.join(d, "same.0000000000000001.pfd"))
        s = n.FileStore(d)
        moved.append(s.quarantined[0]["moved_to"])
        s.close()
    assert moved == [os.path.join(d, "quarantine", "same.0000000000000001.pfd"),
                     os.path.join(d, "quarantine", "same.0000000000000001.pfd.1")]


# ---------------------------------------------------------------- the last good version

def test_previous_version_is_kept_until_the_new_one_is_verified(tmp_path):
    d = str(tmp_path)
    s = n.FileStore(d)
    try:
        v1 = s.write_sync("k", b"1" * 5000)
        s.read_sync("k", bytearray(5000))                # verified read: v1 is known good
        assert s.info("k")["verified"] and s.info("k")["fallback_version"] is None
        p1 = s.info("k")["path"]
        v2 = s.write_sync("k", b"2" * 5000)
        info = s.info("k")
        assert info["version"] == v2 and not info["verified"] and info["fallback_version"] == v1
        assert os.path.exists(p1)                        # not deleted before v2 is verified
        s.read_sync("k", bytearray(5000), verify=False)  # an unverified read proves nothing
        assert os.path.exists(p1)
        s.read_sync("k", bytearray(5000))                # the daemon's verify read
        assert not os.path.exists(p1) and s.info("k")["fallback_version"] is None
        # explicit commit, for callers that verify some other way
        v3 = s.write_sync("k", b"3" * 5000)
        assert s.commit("k", v2) is False                # not the current version: nothing happens
        assert s.info("k")["fallback_version"] == v2
        assert s.commit("k", v3) is True
        assert s.info("k")["fallback_version"] is None and s.info("k")["verified"]
        assert sorted(f for f in os.listdir(d) if f.endswith(".pfd")) == [os.path.basename(s.info("k")["path"])]
        with pytest.raises(n.NotFound):
            s.commit("nope", 1)
    finally:
        s.close()


def test_unverified_versions_do_not_pile_up(tmp_path):
    """Superseded unverified versions go at once; the known-good fallback stays."""
    d = str(tmp_path)
    s = n.FileStore(d)
    try:
        v1 = s.write_sync("k", b"a")
        s.commit("k", v1)
        for i in range(5):
            s.write_sync("k", bytes([i]))
        assert s.info("k")["fallback_version"] == v1
        assert len([f for f in os.listdir(d) if f.endswith(".pfd")]) == 2
        s.remove("k")
        assert [f for f in os.listdir(d) if f.endswith(".pfd")] == []
    finally:
        s.close()


CRASH_IN_WINDOW = textwrap.dedent("""
    import sys, time
    from prefetchd import _native as n
    s = n.FileStore(sys.argv[1])
    s.write_sync("w", b"OLD!" * 25000)
    s.read_sync("w", bytearray(100000))        # verified: the old version is known good
    s.write_sync("w", b"NEW!" * 25000)
    print(s.info("w")["path"], flush=True)     # killed before its verify read
    time.sleep(600)
""")


def test_corrupt_new_version_and_a_crash_before_verify_recover_the_old_version(tmp_path):
    d = str(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", CRASH_IN_WINDOW, d], stdout=subprocess.PIPE, text=True,
                         env=ENV, cwd=REPO)
    new_path = p.stdout.readline().strip()
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    flip_byte(new_path, data_offset(new_path, 100000) + 77777)
    s = n.FileStore(d)
    try:
        out = bytearray(100000)
        s.read_sync("w", out)
        assert out == b"OLD!" * 25000
        [q] = s.quarantined
        assert q["path"] == new_path and q["reason"] == "checksum mismatch in extent 0"
        assert s.info("w")["verified"]
    finally:
        s.close()


def test_intact_new_version_wins_after_a_crash_before_verify(tmp_path):
    d = str(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", CRASH_IN_WINDOW, d], stdout=subprocess.PIPE, text=True,
                         env=ENV, cwd=REPO)
    new_path = p.stdout.readline().strip()
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    s = n.FileStore(d)
    try:
        assert s.info("w")["path"] == new_path and s.recovery_report["removed_old"] == 1
        assert read_key(s, "w") == b"NEW!" * 25000
    finally:
        s.close()


def test_header_key_that_is_not_utf8_is_quarantined(tmp_path):
    """A header whose checksum is right but whose key is not UTF-8 could never be listed as a str."""
    d = str(tmp_path)
    path = write_and_close(d, "ab", b"x")
    with open(path, "r+b") as f:
        header = bytearray(f.read(4096))
        header[57] = 0xFF                                 # key bytes start at 56
        crc_at = 56 + 2 + 0 + 4 * 1                       # key, meta, one extent crc
        header[crc_at:crc_at + 4] = n.crc32c(bytes(header[:crc_at])).to_bytes(4, "little")
        f.seek(0)
        f.write(header)
    s = n.FileStore(d)
    try:
        assert s.keys() == [] and s.quarantined[0]["reason"] == "key is not valid UTF-8"
    finally:
        s.close()


def _fixed_header(key, hsize, nbytes, version, n_ext, data_crc=0):
    """A .pfd header's fixed fields and key, as a FileStore writes them (its format is
    native/include/filestore_format.h: 56 bytes, then the key, meta, extent CRCs, the CRC)."""
    fixed = bytearray(56)
    fixed[0:4] = b"PFD1"
    struct.pack_into("<IIIQQQIII", fixed, 4, 1, hsize, len(key), nbytes, version, 1 << 20, n_ext, 0, data_crc)
    return bytes(fixed) + key


def _plant(d, key, name_version, header, data=b""):
    """Write a .pfd file a FileStore did not write: `header` (CRC32C appended, padded), `data`."""
    header += n.crc32c(header).to_bytes(4, "little")
    path = os.path.join(d, f"{key.decode()}-{'0' * 32}.{name_version:016x}.pfd")
    with open(path, "wb") as f:
        f.write(header + b"\0" * (-len(header) % 4096) + data + b"\0" * (-len(data) % 4096))
    return path


@pytest.mark.parametrize("version, name_version", [(2**64 - 1, None), (2**64 - 1, 0x7000), (0x7001, 0x7000)])
def test_a_version_no_store_writes_is_quarantined_and_later_writes_kept(tmp_path, version, name_version):
    """A planted file at version 2^64-1 (its checksums right) won over the real one, which was
    unlinked, and the next version wrapped to 0: every later write of the key was older than it,
    and lost while write_sync said it succeeded."""
    d = str(tmp_path)
    write_and_close(d, "w", b"REAL" * 1000)
    data = b"FAKE" * 1000                  # its extent checksummed right too
    crc = n.crc32c(data)
    bogus = _plant(d, b"w", name_version or version,
                   _fixed_header(b"w", 4096, len(data), version, 1, crc) + crc.to_bytes(4, "little"), data)
    s = n.FileStore(d)
    try:
        [q] = s.quarantined
        assert q["path"] == bogus and "is not one a store writes, or not its file name's" in q["reason"], q
        assert read_key(s, "w") == b"REAL" * 1000
        s.write_sync("w", b"NEW!" * 1000)
    finally:
        s.close()
    s = n.FileStore(d)
    try:
        assert read_key(s, "w") == b"NEW!" * 1000
    finally:
        s.close()


def test_a_header_size_beyond_its_file_is_not_allocated(tmp_path):
    """n_extents of 2^27 in a 4 KiB file: the header buffer was sized from it (512 MiB, and
    16 GiB at 2^32) before the file was found too short."""
    import resource
    d = str(tmp_path)
    nex = 1 << 27                           # only the header's sizes are read before the allocation
    bogus = _plant(d, b"w", 1, _fixed_header(b"w", (56 + 1 + 4 * nex + 4 + 4095) // 4096 * 4096, 0, 1, nex))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s = n.FileStore(d)
    try:
        [q] = s.quarantined
        assert q["path"] == bogus and q["reason"] == "truncated header", q
    finally:
        s.close()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 128 << 10     # KiB


def test_a_header_whose_sizes_wrap_is_quarantined_and_the_real_version_kept(tmp_path):
    """A header (its checksum right) with nbytes 2^64-1 and no extents: n_extents and the
    expected file size wrapped around to agree with it, so a bogus newer version of 'w' was
    taken as intact, and recovery unlinked the real one."""
    d = str(tmp_path)
    write_and_close(d, "w", b"REAL" * 1000)
    bogus = _plant(d, b"w", 0x7000, _fixed_header(b"w", 4096, 2**64 - 1, 0x7000, 0))
    s = n.FileStore(d)
    try:
        [q] = s.quarantined
        assert q["path"] == bogus and q["reason"] == "data size beyond the file", q
        assert read_key(s, "w") == b"REAL" * 1000 and s.info("w")["nbytes"] == 4000
    finally:
        s.close()
