"""Refusals of the `prefetchd` command for values it would have ignored or paths it would
have damaged, each run as a user would (real subprocesses): a bad command line is one
line and exit code 2, a failure one line and exit code 1, and nothing is changed."""
import os
import stat

from test_cli_small_fixes import one_error_line, run


def test_demo_refuses_a_trace_or_plot_path_that_is_a_fifo_and_leaves_it(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for flag in ("--trace", "--plot"):
        out = run("demo", "--size", "16MiB", "--hidden", "256", "--passes", "1", flag, str(tmp_path / "fifo"))
        assert out.returncode == 2, out.stderr
        assert f"argument {flag}:" in one_error_line(out) and "is a FIFO, not a regular file" in out.stderr
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert os.listdir(tmp_path) == ["fifo"]


def test_config_validate_refuses_a_trace_it_could_not_write(tmp_path):
    for trace, named in ((tmp_path / "missing" / "t.json", "does not exist"), (tmp_path, "is a directory")):
        config = tmp_path / "c.toml"
        config.write_text(f'[prefetchd]\ntrace = "{trace}"\n')
        out = run("config", "validate", "--config", str(config))
        assert out.returncode == 1, out.stderr
        line = one_error_line(out)
        assert line.startswith("prefetchd: error: trace: ") and named in line, line


def test_keys_refuses_a_directory_holding_other_files_and_leaves_its_mode(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)                     # like /tmp
    (shared / "someone-elses.txt").write_text("x")
    out = run("keys", str(shared))
    assert out.returncode == 1, out.stderr
    line = one_error_line(out)
    assert "holds other files ('someone-elses.txt')" in line and "give a new directory" in line, line
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    assert os.listdir(shared) == ["someone-elses.txt"]
    tls = tmp_path / "tls"              # a TLS key named like a certificate: not one, kept
    tls.mkdir(mode=0o750)
    (tls / "server.key").write_text("-----BEGIN PRIVATE KEY-----\nabc\n-----END PRIVATE KEY-----\n")
    out = run("keys", str(tls))
    assert out.returncode == 1 and "holds other files ('server.key')" in one_error_line(out), out.stderr
    assert (tls / "server.key").read_text().startswith("-----BEGIN PRIVATE KEY")
    assert stat.S_IMODE(os.stat(tls).st_mode) == 0o750
    # A new directory, then the same one again (adding a client), are taken.
    for extra in ((), ("--client", "ops")):
        out = run("keys", str(tmp_path / "keys"), *extra)
        assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    for bad, named in (("", "an empty path"), (str(tmp_path / "loop"), "a symlink to nothing")):
        out = run("keys", bad)
        assert out.returncode in (1, 2) and named in one_error_line(out), out.stderr


def test_worker_counts_are_bounded_and_bench_counts_are_not_read_as_the_default(tmp_path, capsys):
    # `serve --workers 99999999` filled 21 GB with worker slots before the first spawn (the
    # OOM killer ended it); `bench sched --requests 0` ran 200000, `--hidden -1` divided by 0.
    # Parsed in this process: were one accepted, nothing would be spawned.
    import pytest

    from prefetchd.cli import build_parser
    cases = [("--workers", "serve", "--workers", "99999999"), ("--workers", "bench", "serve", "--workers", "0"),
             ("--workers", "bench", "serve", "--workers", "1000"), ("--requests", "bench", "sched", "--requests", "0"),
             ("--requests", "bench", "sched", "--requests", "-5"), ("--hidden", "bench", "model", "--hidden", "-1"),
             ("--layers", "bench", "model", "--layers", "0"), ("--batch", "bench", "model", "--batch", "4", "-1"),
             ("--seconds", "bench", "soak", "--seconds", "nan"), ("--minutes", "bench", "soak", "--minutes", "-1"),
             ("--models", "serve", "--models", "99999999"), ("--lookahead", "serve", "--lookahead", "2000"),
             ("--hidden", "serve", "--hidden", "99999999")]
    for flag, *args in cases:
        with pytest.raises(SystemExit) as exit:
            build_parser().parse_args(args)
        assert exit.value.code == 2, args
        assert f"argument {flag}:" in capsys.readouterr().err, args
    out = run("bench", "model", "--hidden", "-1")          # as a user sees it: one line, exit 2
    assert out.returncode == 2 and "argument --hidden: '-1': must be at least 1" in one_error_line(out)
    config = tmp_path / "c.toml"
    config.write_text("[serve]\nworkers = 99999999\n")
    out = run("config", "validate", "--config", str(config))
    assert out.returncode == 1 and "[serve] workers" in one_error_line(out) and "at most 256" in out.stderr


def test_a_front_of_too_many_workers_is_refused_before_it_binds(tmp_path):
    import pytest

    from prefetchd.serve import Front
    with pytest.raises(ValueError, match="workers: 257: expected a whole number from 1 to 256"):
        Front(f"ipc://{tmp_path}/front.sock", workers=257)
    assert os.listdir(tmp_path) == []


def test_a_bad_fault_spec_is_one_line_and_a_good_one_is_announced(tmp_path, monkeypatch, caplog):
    # PREFETCHD_FAULTS=junk made every verb, --version included, a 24-line ImportError
    # traceback; a valid spec injected faults into a production command without a word.
    out = run("--version", env={"PREFETCHD_FAULTS": "junk"})
    assert out.returncode == 1, out.stderr
    line = one_error_line(out)
    assert line.startswith("prefetchd: error: cannot load prefetchd: PREFETCHD_FAULTS: bad entry 'junk'") \
        and "unset it to run normally" in line, line
    from prefetchd.backend.base import open_store
    from prefetchd.config import Config
    monkeypatch.setenv("PREFETCHD_FAULTS", "read:error:nth=1000000")
    with caplog.at_level("WARNING", logger="prefetchd.store"):
        open_store(Config.load(store_dir=str(tmp_path / "store"), env={})).close()
    assert "PREFETCHD_FAULTS=read:error:nth=1000000 is set" in caplog.text
    assert "fault injection for tests" in caplog.text
    caplog.clear()
    monkeypatch.setenv("PREFETCHD_FAULTS", ";")                  # injects nothing: not announced
    with caplog.at_level("WARNING", logger="prefetchd.store"):
        open_store(Config.load(store_dir=str(tmp_path / "store"), env={})).close()
    assert "PREFETCHD_FAULTS" not in caplog.text


def test_ctl_refuses_an_option_its_operation_does_not_read(tmp_path):
    # `ctl pin w0 --no-wait` still waited and `ctl ping --lease 5` dropped the lease, both
    # without a word. Refused before connecting: nothing listens here.
    nobody = f"ipc://{tmp_path}/nobody.sock"
    for args, flag in ((("ping", "--lease", "5"), "--lease"), (("evict", "w0", "--priority", "9"), "--priority"),
                       (("ping", "--priority", "0"), "--priority"),
                       (("pin", "w0", "--no-wait"), "--no-wait"), (("prefetch", "w0", "--lease", "3"), "--lease"),
                       (("unpin", "L1", "--lease", "3"), "--lease")):
        out = run("ctl", "--endpoint", nobody, *args)
        assert out.returncode == 2, (args, out.stderr)
        line = one_error_line(out)
        assert f"ctl {args[0]}: takes no {flag}" in line, line


def test_infer_refuses_an_npy_whose_header_declares_more_than_the_file_holds(tmp_path):
    # It tried to allocate the declared array: "Unable to allocate 1.86 TiB ...", naming no file.
    import numpy as np
    huge = tmp_path / "huge.npy"
    with open(huge, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (1 << 39,)})
        f.write(b"\0" * 16)
    out = run("infer", "--endpoint", f"ipc://{tmp_path / 'nobody.sock'}", "--model", "m0", str(huge))
    assert out.returncode == 2, out.stderr
    line = one_error_line(out)
    assert f"infer: {huge}: not a readable .npy of numbers (its header declares more data than the file " \
           f"holds" in line, line
    sparse = tmp_path / "sparse.npy"            # as long as its header says (1 GiB), all holes
    with open(sparse, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (1 << 28,)})
        f.truncate(f.tell() + (1 << 30))
    out = run("infer", "--endpoint", f"ipc://{tmp_path / 'nobody.sock'}", "--model", "m0", str(sparse))
    assert out.returncode == 2 and "above the 256 MiB a request may carry" in one_error_line(out), out.stderr


def test_a_budget_of_bytes_without_a_unit_is_not_taken_as_a_billion_models(capsys, tmp_path):
    # A bare number is a fraction of the model; `serve --budget 1073741824` failed only once
    # the workers started, with a budget of 14273859951788032 bytes.
    import pytest

    from prefetchd.cli import build_parser
    for args in (["serve", "--budget", "1073741824"], ["bench", "model", "--budget", "1e30"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(args)
        assert "reads as a fraction of the model" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--budget", "1.5"]).budget == 1.5     # one and a half models
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--budget", "1e9"])
    suggested = capsys.readouterr().err.split("give a unit (")[1].split(")")[0]
    assert suggested == "1000000000B" and build_parser().parse_args(["serve", "--budget", suggested]).budget == 10 ** 9
    config = tmp_path / "c.toml"
    config.write_text('[serve]\nbudget = "1073741824"\n')
    out = run("config", "validate", "--config", str(config))
    assert out.returncode == 1 and "[serve] budget" in one_error_line(out) and "give a unit" in out.stderr


def test_status_of_a_server_that_answers_no_prefetchd_status_says_so(tmp_path):
    # A server speaking the protocol with another result printed
    # "TypeError: argument of type 'int' is not iterable".
    import threading

    import zmq

    from prefetchd.control import protocol as P
    endpoint = f"ipc://{tmp_path}/other.sock"
    answers = [12, {}, {"device": {"used": 10 ** 400}}]      # each refused, none a traceback
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    stop = threading.Event()

    def answer():
        while not stop.is_set():
            if router.poll(100):
                envelope, (_, rid, *_) = P.split_envelope(router.recv_multipart())
                router.send_multipart([*envelope, *P.encode_ok(rid, answers[0])])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        for _ in range(3):
            out = run("status", "--endpoint", endpoint)
            assert out.returncode == 1, out.stderr
            line = one_error_line(out)
            assert f"status: {endpoint} answered with a status that is neither a prefetchd daemon's nor a " \
                   f"serve front's" in line and "--json prints what it sent" in line, line
            answers.append(answers.pop(0))
        out = run("status", "--endpoint", endpoint, "--json")
        assert out.returncode == 0 and out.stdout.strip() == "12"
    finally:
        stop.set()
        thread.join(5)
        router.close()
        ctx.term()


def test_infer_checks_out_before_connecting_and_makes_it_only_for_outputs(tmp_path):
    # `--out FILE` said "[Errno 17] File exists"; `--out NEWDIR` was made before a front was found.
    import numpy as np
    np.save(tmp_path / "x.npy", np.ones((1, 4), np.float32))
    (tmp_path / "file").write_text("x")
    nobody = f"ipc://{tmp_path / 'nobody.sock'}"
    out = run("infer", "--endpoint", nobody, "--model", "m0", str(tmp_path / "x.npy"), "--out", str(tmp_path / "file"))
    assert out.returncode == 2 and "argument --out: " in one_error_line(out) and "is a file, not a directory" in out.stderr
    out = run("infer", "--endpoint", nobody, "--model", "m0", str(tmp_path / "x.npy"), "--out", str(tmp_path / "new"))
    assert out.returncode == 1 and "no serve front at" in one_error_line(out)
    assert not (tmp_path / "new").exists()
    # A dangling link passed and the outputs were lost at the end; a FIFO where an output
    # goes hung the write.
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    (tmp_path / "outs").mkdir()
    os.mkfifo(tmp_path / "outs" / "output0.npy")
    for where, says in (("dangling", "is a symlink to nothing"), ("outs", "output0.npy' is a FIFO")):
        out = run("infer", "--endpoint", nobody, "--model", "m0", str(tmp_path / "x.npy"), "--out", str(tmp_path / where))
        assert out.returncode == 2 and says in one_error_line(out), out.stderr


def test_demo_refuses_a_configured_trace_or_busy_port_before_staging_naming_the_setting(tmp_path):
    # The configured ones were taken after staging and a pass: refused only at the end.
    import socket
    os.mkfifo(tmp_path / "fifo")
    out = run("demo", "--size", "16MiB", "--hidden", "256", "--store", str(tmp_path / "store"),
              env={"PREFETCHD_TRACE": str(tmp_path / "fifo")})
    assert out.returncode == 1 and "trace (from env PREFETCHD_TRACE): " in one_error_line(out), out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        out = run("demo", "--size", "16MiB", "--hidden", "256", "--store", str(tmp_path / "store"),
                  env={"PREFETCHD_METRICS_PORT": port})
        assert out.returncode == 1 and "metrics_port (from env PREFETCHD_METRICS_PORT): " in one_error_line(out)
        out = run("demo", "--size", "16MiB", "--hidden", "256", "--metrics-port", port)
        assert out.returncode == 2 and "argument --metrics-port: " in one_error_line(out)
    assert not (tmp_path / "store").exists()
