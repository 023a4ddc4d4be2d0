"""`prefetchd config validate` says OK only for a file the daemons and `prefetchd serve`
read as written: a misspelled table, keys a [prefetchd] table makes the reader skip,
and [serve] or control-plane values that `serve` or a daemon later refuses were
"configuration OK". The real command, in subprocesses."""
import os
import subprocess
import sys

import pytest

from helpers import ENV


def run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, env=dict(ENV, XDG_RUNTIME_DIR=str(cwd)))


def error_line(out):
    lines = [x for x in out.stderr.splitlines() if x.startswith("prefetchd: error: ")]
    assert out.returncode == 1 and len(lines) == 1, (out.returncode, out.stderr)
    return lines[0]


BAD = [
    ("misspelled table", '[prefetch]\ndevice_budget = "1KiB"\n',
     ["unknown table [prefetch]", "did you mean [prefetchd]?"]),
    ("serve table as a value", 'serve = 3\n',                  # was "serve: unknown setting"
     ["serve is not a table: write [serve] on a line of its own"]),
    ("serve table as an array of tables", '[[serve]]\nworkers = 2\n',
     ["serve is not a table", "nor [[serve]]"]),
    ("top-level keys beside [prefetchd]", 'device_budget = "1KiB"\n[prefetchd]\nlookahead = 3\n',
     ["device_budget outside the [prefetchd] table", "move it into [prefetchd]"]),
    ("[serve] endpoint", '[serve]\nendpoint = "foo://x"\n',
     ["[serve] endpoint (from file", "expected ipc://[path] or tcp://host:port"]),
    ("[serve] remote endpoint", '[serve]\nendpoint = "tcp://0.0.0.0:9"\n',
     ["[serve] endpoint (from file", "loopback"]),
    ("[serve] metrics_addr", '[serve]\nmetrics_addr = "not-an-ip"\n',
     ["[serve] metrics_addr (from file", "'not-an-ip' is not an IP address"]),
    ("[serve] shared_host without a checkpoint store", '[serve]\nshared_host = true\n',   # validate said OK
     ["--shared-host needs --checkpoint-store"]),
    ("[serve] model that cannot be imported", '[serve]\nmodel = "nosuchmodule:build"\n',
     ["cannot import nosuchmodule"]),
    ("[serve] checkpoint store that is not there", '[serve]\ncheckpoint_store = "/nonexistent/ckpt"\n',
     ["--checkpoint-store /nonexistent/ckpt: not a directory"]),
    ("allow_remote without keys", '[prefetchd]\nallow_remote = true\nendpoint = "tcp://0.0.0.0:5555"\n',
     ["allow_remote without curve_keys_dir"]),
]


@pytest.mark.parametrize("what, text, says", BAD, ids=[b[0] for b in BAD])
def test_validate_refuses_what_is_ignored_or_refused_later(tmp_path, what, text, says):
    path = tmp_path / "c.toml"
    path.write_text(text)
    line = error_line(run("config", "validate", "--config", str(path), cwd=tmp_path))
    assert "configuration OK" not in line
    for needle in says:
        assert needle in line, line
    if "[serve]" in what:                 # serve refuses it the same way, before a worker starts
        out = run("serve", "--config", str(path), "--workers", "1", "--store", str(tmp_path / "s"),
                  cwd=tmp_path)
        assert error_line(out) == line
        assert not (tmp_path / "s").exists()
    elif "table" in what or "top-level" in what:   # and so does every reader of the file
        assert error_line(run("config", "show", "--config", str(path), cwd=tmp_path)) == line


@pytest.mark.parametrize("text", [
    'lookahead = 3\n[serve]\nworkers = 2\n',                      # flat daemon settings + [serve]
    '[prefetchd]\nlookahead = 3\n[serve]\nendpoint = "ipc://x.sock"\nmetrics_addr = "0.0.0.0"\n',
    '[prefetchd]\nendpoint = "tcp://127.0.0.1:5555"\n',
])
def test_validate_still_passes_good_files(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    out = run("config", "validate", "--config", str(path), cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "configuration OK", out.stderr


def test_the_deploy_example_validates(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = run("config", "validate", "--config", os.path.join(repo, "deploy/examples/serve-config.toml"),
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("table", ["prefetchd", "serve"])
def test_validate_refuses_an_ipc_endpoint_in_a_shared_directory(tmp_path, table):
    # Anyone who can write there could replace the socket: the daemon's bind and the front's
    # refuse it as they start, and validate said "configuration OK" (an outside probe).
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    path = tmp_path / "c.toml"
    path.write_text(f'[{table}]\nendpoint = "ipc://{shared}/x.sock"\n')
    line = error_line(run("config", "validate", "--config", str(path), cwd=tmp_path))
    assert f"socket directory {shared} is group- or world-writable" in line, line
    if table == "serve":
        out = run("serve", "--config", str(path), "--workers", "1", "--store", str(tmp_path / "s"),
                  cwd=tmp_path)
        assert error_line(out) == line
    else:
        out = subprocess.run([sys.executable, "-c", "import prefetchd; prefetchd.Daemon(device_budget="
                              "'64KiB', store_dir='s').start()"], capture_output=True, text=True,
                             cwd=tmp_path, timeout=120, env=dict(ENV, PREFETCHD_CONFIG=str(path)))
        assert f"ConfigError: socket directory {shared} is group- or world-writable" in out.stderr


def test_a_stale_runtime_directory_is_named(tmp_path):
    # A $XDG_RUNTIME_DIR kept from another session: os.mkdir's bare ENOENT, naming a path
    # the user never gave, was all `status` and the daemon said.
    gone = tmp_path / "gone"
    for args in (["status"], ["config", "validate"]):
        out = subprocess.run([sys.executable, "-m", "prefetchd.cli", *args], capture_output=True,
                             text=True, cwd=tmp_path, timeout=120,
                             env=dict(ENV, XDG_RUNTIME_DIR=str(gone), PREFETCHD_ENDPOINT="ipc://"))
        line = error_line(out)
        assert f"$XDG_RUNTIME_DIR is {gone}, which is not a directory" in line, line
