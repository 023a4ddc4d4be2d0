"""The `prefetchd` command, run as a user would (a real subprocess)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env={**os.environ, **(env or {})})


def test_help_lists_the_commands():
    out = run("--help")
    assert out.returncode == 0
    for command in ("demo", "bench", "stage", "config", "collect-env", "status", "serve"):
        assert command in out.stdout


def test_collect_env_reports_versions_native_build_and_io_engine(tmp_path):
    out = run("collect-env", "--store", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    env = json.loads(out.stdout)
    assert env["packages"]["mindspore"] == "2.10.0"
    assert env["native"]["crc32c"] in ("sse4.2", "table")
    assert env["io_probe"]["engine"] in ("aio", "threads", "buffered")
    assert env["io_probe"]["report"]


def test_config_show_merges_file_env_and_validate_names_the_bad_key(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[prefetchd]\ndevice_budget = "2GiB"\nlookahead = 3\n')
    out = run("config", "show", "--config", str(good), "--json", env={"PREFETCHD_LOOKAHEAD": "5"})
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["device_budget"] == 2 << 30 and shown["lookahead"] == 5     # env beats the file
    bad = tmp_path / "bad.toml"
    bad.write_text('device_budget = "lots"\n')
    out = run("config", "validate", "--config", str(bad))
    assert out.returncode == 1                       # a bad config value is a failure, not a usage error
    assert "device_budget" in out.stderr and "lots" in out.stderr and str(bad) in out.stderr


def test_demo_runs_and_checks_its_outputs(tmp_path):
    out = run("demo", "--size", "96MiB", "--hidden", "512", "--passes", "2", "--json", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["outputs_match"] and report["watermark_respected"]
    assert report["peak_device_bytes"] <= report["high_watermark"] < report["model_bytes"]
    assert report["bytes_moved"] > 0
