"""Small defects of the `prefetchd` command found from outside, each run as a user
would (real subprocesses): a bad command line is one line and exit code 2, a failure
one line and exit code 1."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout, env={**os.environ, **(env or {})})


def one_error_line(out):
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("prefetchd: error: "), out.stderr
    return lines[0]


def test_bench_io_refuses_a_size_it_cannot_measure(tmp_path):
    # --size 0 divided by zero (exit 1); 1 byte rounded every MB/s to 0 and divided by it.
    for size, named in (("0", "'0' is out of range"), ("1", "at least 1MiB"),
                        ("lots", "'lots'"), ("0.5", "'0.5'")):
        out = run("bench", "io", "--size", size, "--json", "--dir", str(tmp_path))
        assert out.returncode == 2, (size, out.stderr)
        line = one_error_line(out)
        assert "--size" in line and named in line, line
    # A size that is not whole 8-byte words failed filling the buffer (a TypeError).
    out = run("bench", "io", "--size", str((1 << 20) + 3), "--repeats", "1", "--no-drop-caches",
              "--json", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr


def test_ctl_takes_options_and_names_in_any_order(tmp_path):
    from prefetchd.cli import build_parser

    # Options before the names left NAME over: "unrecognized arguments: NAME", exit 2.
    args = build_parser().parse_args(["ctl", "--endpoint", "ipc://x.sock", "prefetch", "--priority",
                                      "5", "--no-wait", "a", "--lease", "3", "b"])
    assert (args.op, args.args, args.priority, args.no_wait, args.lease) == \
        ("prefetch", ["a", "b"], 5, True, 3.0)
    nobody = f"ipc://{tmp_path / 'nobody.sock'}"
    out = run("ctl", "--endpoint", nobody, "prefetch", "--priority", "5", "--no-wait", "NAME")
    assert out.returncode == 1 and "the socket file does not exist" in one_error_line(out)
    # Arguments an operation does not take were ignored (ping) or all but the first (list).
    for op, extra in (("ping", ["extra", "args"]), ("stats", ["x"]), ("list", ["a*", "b*"])):
        out = run("ctl", "--endpoint", nobody, op, *extra)
        assert out.returncode == 2, (op, out.stderr)
        assert f"ctl {op}: takes" in one_error_line(out) and extra[-1] in one_error_line(out)


def test_config_validate_checks_the_serve_table_as_serve_does(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[prefetchd]\nlookahead = 3\n[serve]\nworkers = 2\nbudget = "25%"\n')
    out = run("config", "validate", "--config", str(good))
    assert out.returncode == 0 and out.stdout.strip() == "configuration OK", out.stderr
    # Each said "configuration OK" (exit 0), and serve refused the same file.
    for table, named in (("workerz = 2", "[serve] workerz: unknown setting"),
                         ('workers = "two"', "[serve] workers"),
                         ("heartbeat_timeout = 0", "[serve] heartbeat_timeout")):
        bad = tmp_path / "bad.toml"
        bad.write_text(f"[serve]\n{table}\n")
        for how in (["--config", str(bad)], []):          # the flag, or $PREFETCHD_CONFIG
            out = run("config", "validate", *how, env={"PREFETCHD_CONFIG": str(bad)})
            line = one_error_line(out)
            assert out.returncode == 1 and named in line and str(bad) in line, out.stderr


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    # `prefetchd config show --json | head -1` printed "prefetchd: error: [Errno 32] Broken pipe";
    # --help and --version (argparse's own printing, which drops the error) exited 0.
    for args in (["config", "show", "--json"], ["collect-env", "--store", str(tmp_path)],
                 ["--version"], ["--help"], ["stage", "--help"], ["collect-env", "--version"]):
        p = subprocess.Popen([sys.executable, "-m", "prefetchd.cli", *args], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        p.stdout.close()                         # the reader is gone before anything is written
        _, err = p.communicate(timeout=120)
        assert p.returncode == 141 and err == "", (args, p.returncode, err)


def test_a_metrics_port_in_use_is_named_with_its_setting(tmp_path):
    import socket

    import prefetchd

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        # It was a bare "[Errno 98] Address already in use": no port, no setting. (Refused
        # before staging now: a usage error, exit 2.)
        out = run("demo", "--size", "96MiB", "--hidden", "512", "--passes", "1",
                  "--metrics-port", str(port), timeout=300)
        line = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 2 and line.startswith("prefetchd: error: "), out.stderr
        assert f"127.0.0.1:{port}" in line and "--metrics-port" in line, line
        d = prefetchd.Daemon(device_budget=1 << 20, store_dir=str(tmp_path), metrics_port=port)
        try:
            d.start()
            raise AssertionError("a second exporter bound a port in use")
        except OSError as e:
            assert f"127.0.0.1:{port}" in str(e) and "metrics_port" in str(e), e
        finally:
            d.close()
    finally:
        taken.close()


def test_infer_with_no_socket_file_says_so_at_once(tmp_path):
    import time

    import numpy as np

    x = tmp_path / "x.npy"
    np.save(x, np.zeros((2, 3), np.float32))
    started = time.monotonic()
    out = run("infer", "--endpoint", f"ipc://{tmp_path / 'nobody.sock'}", "--model", "m0", str(x),
              "--timeout", "30", "--out", str(tmp_path / "out"))
    # It waited the whole --timeout: "no reply ... within 30s".
    assert out.returncode == 1 and time.monotonic() - started < 20, out.stderr
    line = one_error_line(out)
    assert "the socket file does not exist" in line and "serve front" in line, line


def test_a_negative_value_is_out_of_range_not_a_missing_argument():
    # A leading '-' looked like an option: "argument --budget: expected one argument".
    for args in (["demo", "--budget", "-5%"], ["demo", "--budget", "-1GiB"],
                 ["demo", "--size", "-1GiB"], ["bench", "io", "--size", "-1GiB"],
                 ["serve", "--budget", "-25%"], ["serve", "--model-bytes", "-512MiB"]):
        out = run(*args)
        line = one_error_line(out)
        assert out.returncode == 2 and f"argument {args[-2]}: '{args[-1]}' is out of range" in line, line


def test_ctl_set_watermarks_refuses_a_negative_or_nan_before_connecting(tmp_path):
    # -5% reached the daemon once '-5%' parsed as a value; nan failed in JSON encoding (exit 1).
    endpoint = f"ipc://{tmp_path / 'nobody.sock'}"          # nothing there: refused before connecting
    for value in ("-5%", "-1", "nan", "inf"):
        out = run("ctl", "--endpoint", endpoint, "set-watermarks", value)
        assert out.returncode == 2 and "set-watermarks" in one_error_line(out), (value, out.stderr)


def test_infer_on_a_file_that_is_not_npy_says_so_not_pickle(tmp_path):
    # numpy falls back to reading a pickle and blamed that: "Cannot load file containing
    # pickled data when allow_pickle=False", for a text file named .npy.
    text = tmp_path / "x.npy"
    text.write_text("1 2 3\n")
    out = run("infer", "--endpoint", f"ipc://{tmp_path / 'nobody.sock'}", "--model", "m0", str(text))
    assert out.returncode == 2, out.stderr
    line = one_error_line(out)
    assert "does not start as a .npy file does" in line and "pickle" not in line.split("(")[0], line


def test_status_of_a_killed_daemons_socket_says_nothing_listens_at_once(tmp_path):
    import signal
    import time

    # A daemon killed before it closed leaves its socket file: status waited its whole
    # --timeout and said "no reply", as if the daemon were only slow.
    sock = tmp_path / "killed.sock"
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, prefetchd\n"
        f"d = prefetchd.Daemon(device_budget=1 << 20, store_dir={str(tmp_path / 'store')!r}, "
        f"endpoint={'ipc://' + str(sock)!r}).start()\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "up"
        assert run("status", "--endpoint", f"ipc://{sock}", "--timeout", "30").returncode == 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert sock.exists()
    started = time.monotonic()
    out = run("status", "--endpoint", f"ipc://{sock}", "--timeout", "30")
    assert out.returncode == 1 and time.monotonic() - started < 20, out.stderr
    line = one_error_line(out)
    assert "nothing listens" in line and str(sock) in line, line


def test_a_client_endpoints_port_out_of_range_is_a_bad_command_line(tmp_path):
    # tcp://127.0.0.1:99999 was handed to libzmq and waited --timeout for "no reply".
    for endpoint, named in (("tcp://127.0.0.1:99999", "from 0 to 65535"), ("tcp://127.0.0.1:x", "from 0 to 65535"),
                            ("tcp://127.0.0.1:0", "the port its server listens on")):
        out = run("status", "--endpoint", endpoint, "--timeout", "30")
        assert out.returncode == 2, (endpoint, out.stderr)
        line = one_error_line(out)
        assert "--endpoint" in line and named in line, line
