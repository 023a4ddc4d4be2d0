"""The `prefetchd` command as the README describes it, run as a user would (real
subprocesses): the shared options after any verb, `demo --budget` in bytes or
as a fraction of the model built, bad values refused at argument parsing (exit
2, one line, before anything is staged or started), and paths that say what is
wrong with them (`keys`, `stage`, `status --curve-dir`)."""
import json
import os
import subprocess
import sys
import time

from prefetchd import __version__

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A demo small enough for a test: about 24 MiB of weights, 8 blocks.
SMALL_DEMO = ("--size", "24MiB", "--hidden", "256", "--passes", "1", "--batch", "2", "--seq", "8")


def run(*args, env=None, timeout=120):
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout, env=env)


def one_error_line(out):
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("prefetchd: error: "), out.stderr
    return lines[0]


def usage_error(*args, named=(), env=None):
    """Run a command line that must be refused at once: exit 2, one line naming `named`."""
    t0 = time.monotonic()
    out = run(*args, env=env)
    assert out.returncode == 2, (args, out.returncode, out.stderr[-2000:])
    line = one_error_line(out)
    for needle in named:
        assert needle in line, (args, line)
    assert time.monotonic() - t0 < 60, "refused only after running"
    return line


# ----------------------------------------------------------------------------- shared options

def test_every_verb_takes_version_log_level_and_debug_after_it_too(tmp_path):
    import argparse

    from prefetchd.cli import build_parser
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for verb, p in subs.choices.items():
        flags = {s for a in p._actions for s in a.option_strings}
        assert {"--version", "--log-level", "--debug"} <= flags, verb

    out = run("config", "show", "--debug")
    assert out.returncode == 0, out.stderr
    out = run("collect-env", "--store", str(tmp_path), "--log-level", "ERROR", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["prefetchd"] == __version__
    out = run("status", "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"prefetchd {__version__}"
    # --debug after the verb does what it does before it: the traceback of a failure.
    nobody = f"ipc://{tmp_path / 'nobody.sock'}"
    out = run("status", "--endpoint", nobody, "--timeout", "0.3", "--debug")
    assert out.returncode == 1 and "Traceback" in out.stderr, out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[prefetchd]\nlookahead = "many"\n')
    out = run("config", "validate", "--config", str(bad), "--debug")
    assert out.returncode == 1 and "Traceback" in out.stderr and "lookahead" in out.stderr
    usage_error("collect-env", "--log-level", "LOUD", named=("--log-level", "LOUD"))


def test_log_level_after_the_verb_wins_over_the_one_before(tmp_path):
    probe = ("import logging, sys; from prefetchd.cli import main; main(sys.argv[1:]); "
             "print(logging.getLevelName(logging.getLogger().level))")
    config = tmp_path / "empty.toml"
    config.write_text("")
    verb = ["config", "validate", "--config", str(config)]
    for argv, env_level, want in (
            (["--log-level", "DEBUG", *verb, "--log-level", "ERROR"], None, "ERROR"),
            (["--log-level", "ERROR", *verb, "--log-level", "INFO"], None, "INFO"),
            (["--log-level", "ERROR", *verb], "INFO", "ERROR"),
            ([*verb, "--log-level", "ERROR"], "INFO", "ERROR"),
            (verb, "INFO", "INFO"),                      # $PREFETCHD_LOG_LEVEL, neither flag
            (verb, None, "WARNING"),
            ([*verb, "--debug"], None, "DEBUG")):
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True,
                             cwd=REPO, timeout=120,
                             env={**{k: v for k, v in os.environ.items()
                                     if k != "PREFETCHD_LOG_LEVEL"},
                                  **({"PREFETCHD_LOG_LEVEL": env_level} if env_level else {})})
        assert out.returncode == 0, (argv, out.stderr)
        assert out.stdout.splitlines()[-1] == want, (argv, env_level, out.stdout)


# ----------------------------------------------------------------------------- demo --budget

def test_demo_budget_in_bytes_is_those_bytes_and_a_percentage_is_of_the_model_built():
    # 12MiB of a --size 24MiB model is 12 MiB, not half of whatever model gets built.
    out = run("demo", *SMALL_DEMO, "--budget", "12MiB", "--json", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["device_budget"] == 12 << 20
    assert report["model_bytes"] != 24 << 20          # the model built is not exactly --size
    out = run("demo", *SMALL_DEMO, "--budget", "50%", "--json", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["device_budget"] == report["model_bytes"] // 2
    # The text report shows the budget's share of the real model.
    out = run("demo", *SMALL_DEMO, "--budget", "12MiB", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    share = (12 << 20) / report["model_bytes"]
    assert f"device budget 12.0 MiB ({share:.0%}" in out.stdout, out.stdout


def test_demo_budget_out_of_range_is_refused_at_parsing_naming_the_forms():
    for budget in ("150%", "1.5", "0", "0%", "0B", "-5%"):
        line = usage_error("demo", *SMALL_DEMO, f"--budget={budget}",
                           named=("--budget", "2GiB", "25%"))
        assert budget in line
    # More bytes than the model --size 32MiB builds (one 56.6 MiB block at hidden 1024).
    line = usage_error("demo", "--size", "32MiB", "--budget", "2GiB",
                       named=("--budget", "2,048.0 MiB", "56.6 MiB", "25%"))
    assert "ValueError" not in line and "run_demo" not in line
    # Help agrees: no budget above the model.
    out = run("demo", "--help")
    assert out.returncode == 0 and "one and a half" not in out.stdout
    assert "100%" in " ".join(out.stdout.split())


# ----------------------------------------------------------------------------- refused up front

def test_bad_values_are_refused_before_anything_runs(tmp_path):
    for value in ("99999", "-1", "http"):
        usage_error("demo", *SMALL_DEMO, f"--metrics-port={value}",
                    named=("--metrics-port", value))
    missing = tmp_path / "no" / "such"
    usage_error("demo", *SMALL_DEMO, "--trace", str(missing / "t.json"),
                named=("--trace", str(missing)))
    usage_error("demo", *SMALL_DEMO, "--trace", str(tmp_path), named=("--trace", "directory"))
    usage_error("demo", *SMALL_DEMO, "--plot", str(missing / "t.png"),
                named=("--plot", str(missing)))
    usage_error("serve", "--metrics-port", "70000", named=("--metrics-port",))
    usage_error("serve", "--model", "nosuch.mod:fn", named=("--model", "nosuch"))
    usage_error("serve", "--model", "os:no_such_function", named=("--model", "no_such_function"))
    usage_error("serve", "--model", "json", named=("--model", "module:function"))
    usage_error("serve", "--endpoint", "http://x", named=("--endpoint", "http://x", "tcp://"))
    usage_error("serve", "--endpoint", "tcp://127.0.0.1", named=("--endpoint", "port"))
    assert not os.listdir(tmp_path)


# ----------------------------------------------------------------------------- paths

def test_keys_client_names_are_plain_names_and_dir_must_be_a_directory(tmp_path):
    keys = tmp_path / "keys"
    for name in ("../evil", "..", ".", "", "a/b", "/tmp/evil", "server"):
        usage_error("keys", str(keys), f"--client={name}", named=("--client",))
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)    # nothing written anywhere
    out = run("keys", str(keys), "--client", "alice")
    assert out.returncode == 0, out.stderr
    assert (keys / "alice.key_secret").is_file() and not (tmp_path / "evil.key_secret").exists()

    existing = tmp_path / "existing_file.txt"
    existing.write_text("not a directory\n")
    for target in (existing, existing / "sub"):
        out = run("keys", str(target))
        line = one_error_line(out)
        assert out.returncode == 1 and "Errno" not in line
        assert f"{existing} is a file, not a directory" in line, line
    assert existing.read_text() == "not a directory\n"


def test_stage_a_directory_and_a_missing_curve_dir_say_so(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    out = run("stage", str(ckpt_dir), "--store", str(tmp_path / "store"))
    line = one_error_line(out)
    assert out.returncode == 1 and "unknown checkpoint format" not in line
    assert f"{ckpt_dir} is a directory" in line and ".ckpt" in line and ".safetensors" in line
    assert not (tmp_path / "store").exists()

    missing = tmp_path / "nonexistent"
    out = run("status", "--endpoint", "tcp://127.0.0.1:9", "--curve-dir", str(missing))
    line = one_error_line(out)
    assert out.returncode == 1 and "z85" not in line
    assert str(missing) in line and "does not exist" in line
    out = run("status", "--endpoint", "tcp://127.0.0.1:9", "--curve-dir", str(ckpt_dir))
    line = one_error_line(out)
    assert out.returncode == 1 and "z85" not in line and "server.key" in line


def test_bench_model_budget_in_bytes_is_those_bytes(tmp_path):
    """It was a fraction of --size applied to the model built (whole layers, not --size)."""
    out = run("bench", "model", "--json", "--size", "1MiB", "--hidden", "128", "--batch", "1", "--repeats", "1",
              "--steady", "--budget", "300KiB", "--dir", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["device_budget"] == 300 << 10 and report["model_bytes"] != 1 << 20, report["model_bytes"]
