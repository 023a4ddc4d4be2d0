"""The `prefetchd` command's contract, run as a user would (real subprocesses):
--version, one-line errors with exit code 2 for a bad command line and 1 for a
failure, tracebacks only with --debug, and help text for every flag."""
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120, env={**os.environ, **(env or {})})


def one_error_line(out):
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("prefetchd: error: "), out.stderr
    return lines[0]


def test_version():
    from prefetchd import __version__
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"prefetchd {__version__}"


def test_usage_errors_are_one_line_and_exit_2():
    for args, named in ((["--log-level", "LOUD", "status"], "LOUD"),
                        (["demo", "--budget", "lots"], "lots"),
                        (["serve", "--workers", "zero"], "zero"),
                        (["bench", "model", "--host-budget", "nan"], "--host-budget"),
                        (["bench", "model", "--host-budget", "-1"], "--host-budget"),
                        (["serve", "--model", "no_such_module_x:build"], "no_such_module_x"),
                        (["status", "--timeout", "1e9"], "at most 1e+06"),
                        (["frobnicate"], "frobnicate"),
                        # each of these ran (or hung) before it failed, if it failed at all:
                        (["demo", "--size", "0"], "--size 0"),
                        # it told to set allow_remote and CURVE keys, which the front ignores
                        (["serve", "--endpoint", "tcp://0.0.0.0:5700"], "no CURVE authentication"),
                        (["demo", "--size", "64MiB", "--hidden", "3"], "114123 blocks"),
                        (["demo", "--hold", "nan"], "--hold"),
                        (["demo", "--size", "128MiB"], "the smallest that fits is --budget 43MiB"),
                        # named --budget without saying it was the default value (a probe)
                        (["demo", "--size", "128MiB"], "--budget: 25% (26.2 MiB, the default) is too small"),
                        (["demo", "--lookahead", "-1"], "'-1': must be >= 0"),
                        # a malformed flag was exit 1, as a failure (an outside probe)
                        (["status", "--endpoint", "garbage"], "status: argument --endpoint"),
                        (["ctl", "--endpoint", "tcp://nohost", "ping"], "ctl: argument --endpoint")):
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert named in one_error_line(out)


def test_keys_in_a_directory_that_cannot_be_made_says_what_it_was_making(tmp_path):
    out = run("keys", "/proc/prefetchd-keys")            # root may write anywhere else
    line = one_error_line(out)
    assert out.returncode == 1 and "keys: cannot create the certificates in /proc/prefetchd-keys" in line


def test_a_bad_log_level_in_the_environment_is_named_as_such():
    out = run("config", "show", env={"PREFETCHD_LOG_LEVEL": "junk"})
    assert out.returncode == 2
    line = one_error_line(out)
    assert "$PREFETCHD_LOG_LEVEL: log level 'junk'" in line and "--log-level" not in line
    assert run("config", "show", env={"PREFETCHD_LOG_LEVEL": "info"}).returncode == 0


def test_failures_are_one_line_exit_1_and_traceback_only_with_debug(tmp_path):
    missing = tmp_path / "nope.ckpt"
    out = run("stage", str(missing), "--store", str(tmp_path / "s"))
    assert out.returncode == 1 and str(missing) in one_error_line(out)
    assert "Traceback" not in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[prefetchd]\nlookahead = "many"\n')
    out = run("config", "validate", "--config", str(bad))
    assert out.returncode == 1 and "lookahead" in one_error_line(out)
    out = run("--debug", "config", "validate", "--config", str(bad))
    assert out.returncode == 1 and "Traceback" in out.stderr
    # Budgets no Daemon on this machine would take: validate said "configuration OK".
    bad.write_text('[prefetchd]\nhost_budget = "1000TiB"\n')
    out = run("config", "validate", "--config", str(bad))
    assert out.returncode == 1 and "host_budget 1000 TiB" in one_error_line(out), out.stderr
    # A --model module that exists but fails to import is a failure, not a bad command line.
    (tmp_path / "broken_factory_x.py").write_text("import no_such_dependency_x\n")
    out = run("serve", "--model", "broken_factory_x:build", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1 and "no_such_dependency_x" in one_error_line(out)


def test_serve_options_that_cannot_go_together_are_refused_before_anything_starts(tmp_path):
    # Each was checked only after the front started (exit 1, after "starting 2 workers").
    for args, words in ((["--shared-host"], "--shared-host needs --checkpoint-store"),
                        (["--model", "prefetchd.demo.model:build_model", "--budget", "25%"],
                         "needs --model-bytes")):
        out = run("serve", *args)
        assert out.returncode == 2 and words in one_error_line(out), out.stderr
        # The same from the [serve] table of a config file is a configuration error, exit 1.
        cfg = tmp_path / "serve.toml"
        cfg.write_text("[serve]\nshared_host = true\n" if "--shared-host" in args else
                       '[serve]\nbudget = "25%"\nmodel = "prefetchd.demo.model:build_model"\n')
        out = run("serve", "--config", str(cfg))
        line = one_error_line(out)
        assert out.returncode == 1 and words in line and str(cfg) in line, out.stderr


def test_serve_start_timeout_is_a_flag(tmp_path):
    # Workers import MindSpore and build the model: not within 0.5 s (it was fixed at 180 s).
    out = run("serve", "--start-timeout", "0.5", "--store", str(tmp_path / "s"))
    assert out.returncode == 1, out.stderr
    assert "workers not ready within 0.5s (--start-timeout)" in out.stderr.splitlines()[-1]
    assert run("serve", "--start-timeout", "0").returncode == 2


def test_every_flag_has_help_and_budget_means_the_same_everywhere():
    import argparse

    from prefetchd.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    verbs = {"root": parser, **subs.choices}
    for verb, p in verbs.items():
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{verb}: {action.option_strings or action.dest} has no help"
    for verb in ("demo", "bench", "serve"):
        out = run(verb, "--help")
        assert out.returncode == 0 and "25%" in out.stdout and "2GiB" in out.stdout, verb


def test_status_of_a_daemon_with_no_socket_file_says_so_at_once(tmp_path):
    started = time.monotonic()
    out = run("status", "--endpoint", f"ipc://{tmp_path / 'nobody.sock'}", "--timeout", "30")
    assert out.returncode == 1 and time.monotonic() - started < 20      # not the 30 s timeout
    assert "the socket file does not exist" in one_error_line(out)


def test_a_name_or_store_path_that_could_escape_is_a_usage_error(tmp_path):
    out = run("status", "--name", "../../x", "--timeout", "0.5")
    assert out.returncode == 2 and "--name" in one_error_line(out)
    out = run("stage", str(tmp_path / "x.ckpt"), "--store", "")
    assert out.returncode == 2 and "an empty path" in one_error_line(out)
