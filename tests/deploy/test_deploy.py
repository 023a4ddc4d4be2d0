"""The deploy/ examples stay usable: the systemd unit verifies and its ExecStart
runs the venv's `prefetchd` with flags `prefetchd serve` accepts; the
Kubernetes example names the command the same way and ships a config prefetchd
loads; every example TOML uses known keys only; the Prometheus and Grafana
files parse. `promtool check` and a real Prometheus run in
tests/telemetry/test_prometheus_integration.py, not here.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefetchd.config import Config
from prefetchd.errors import ConfigError

from _yaml import yaml_documents

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "prefetchd-serve.service"
SHMEM_HUGE = DEPLOY / "systemd" / "prefetchd-shmem-huge.conf"
KUBE = DEPLOY / "kubernetes" / "prefetchd-serve.yaml"


def _serve_parser():
    from prefetchd.cli.serve import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser


def _check_serve_command(argv, config_path=None):
    """`prefetchd serve` would accept `argv` (flags and their values)."""
    from prefetchd.cli.serve import serve_options, serve_spec
    assert argv[0] == "serve", argv
    args = _serve_parser().parse_args(argv)
    if config_path is not None:
        args.config = str(config_path)
    return serve_spec(serve_options(args))


def _unit_values(key):
    return [line.split("=", 1)[1] for line in UNIT.read_text().splitlines()
            if line.startswith(key + "=")]


# -- systemd

def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package `systemd`)")
    unit = tmp_path / UNIT.name
    shutil.copy(UNIT, unit)
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert UNIT.name not in out.stdout + out.stderr, out.stdout + out.stderr   # no warnings either


def _exec_start_argv():
    """ExecStart as the argv systemd runs: its quoting undone, `$$` turned into `$`.
    A lone `$` would be expanded by systemd itself (empty if unset), so there is none."""
    (line,) = _unit_values("ExecStart")
    assert not re.search(r"(?<!\$)\$(?!\$)", line.replace("$$", "")), \
        f"ExecStart leaves a variable to systemd: {line}"
    return [arg.replace("$$", "$") for arg in shlex.split(line)]


def test_systemd_exec_start_runs_the_venv_command(tmp_path):
    argv = _exec_start_argv()
    assert os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK), argv[0]   # systemd requires it
    (default,) = [v for v in _unit_values("Environment") if v.startswith("PREFETCHD_VENV=")]
    assert os.path.isabs(default.split("=", 1)[1])
    # A venv whose bin/prefetchd records the arguments it was started with.
    venv = tmp_path / "venv with space"
    (venv / "bin").mkdir(parents=True)
    recorded = tmp_path / "argv.json"
    script = venv / "bin" / "prefetchd"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"json.dump(sys.argv[1:], open({str(recorded)!r}, 'w'))\n")
    script.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PREFETCHD_VENV": str(venv)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    args = json.loads(recorded.read_text())
    spec = _check_serve_command(args)
    assert spec.model_names() == ["m0", "m1"]
    assert "--metrics-port" in args and "--endpoint" in args
    # Unset: the service fails at once and says what to set, rather than exec'ing /bin/prefetchd.
    out = subprocess.run(argv, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "set PREFETCHD_VENV" in out.stderr, out.stderr


def test_a_venv_install_has_the_command_the_unit_runs():
    if sys.prefix == sys.base_prefix:
        pytest.skip("not running from a venv")
    command = Path(sys.prefix) / "bin" / "prefetchd"
    assert command.is_file() and os.access(command, os.X_OK), command
    out = subprocess.run([str(command), "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--checkpoint-store" in out.stdout, out.stderr


def test_tmpfiles_snippet_sets_shmem_huge_pages_to_advise(tmp_path):
    """Applied under a scratch root (never this machine's /sys), the snippet writes
    `advise` to the file prefetchd reads the mode from."""
    from prefetchd.sharedhost.blocks import SHMEM_HUGE as SYSFS
    tmpfiles = shutil.which("systemd-tmpfiles")
    if tmpfiles is None:
        pytest.skip("systemd-tmpfiles is not installed (Debian package `systemd`)")
    target = tmp_path / SYSFS.lstrip("/")
    target.parent.mkdir(parents=True)
    target.write_text("")
    subprocess.run([tmpfiles, "--create", f"--root={tmp_path}", str(SHMEM_HUGE)],
                   check=True, capture_output=True, timeout=30)
    assert target.read_text().strip() == "advise"


# -- Kubernetes

def test_kubernetes_example(tmp_path):
    docs = {d["kind"]: d for d in yaml_documents(KUBE)}
    assert set(docs) == {"ConfigMap", "Deployment", "Service"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False
    assert not docs["Service"]["metadata"]["name"].lower().startswith("prefetchd")
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    # Kubernetes expands $(VAR) from the container's env; an unknown one stays literal.
    command = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                     container["command"][0])
    assert os.path.isabs(command) and command.endswith("/bin/prefetchd"), command
    config = tmp_path / "prefetchd.toml"
    config.write_text(docs["ConfigMap"]["data"]["prefetchd.toml"])
    Config.load(str(config), env={})                   # unknown keys or bad values raise
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["config"]
    assert env["PREFETCHD_CONFIG"] == f"{mount}/prefetchd.toml"
    spec = _check_serve_command(container["args"], config)
    # The metrics port opens once the workers are ready: liveness waits for a startup probe
    # that allows longer than serve's own start timeout (it killed a slow start in a loop).
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["tcpSocket"]["port"] == liveness["tcpSocket"]["port"] == "metrics"
    start_timeout = _serve_parser().parse_args(container["args"]).start_timeout
    assert startup["periodSeconds"] * startup["failureThreshold"] > (start_timeout or 180.0), spec


def test_the_unit_stops_retrying_a_start_that_keeps_failing_and_allows_io_nice():
    """RestartSec=5 never trips systemd's default start limit (5 in 10 s): a bad setting
    restarted forever. io_nice (default -10) needs RLIMIT_NICE without CAP_SYS_NICE."""
    (interval,), (burst,) = _unit_values("StartLimitIntervalSec"), _unit_values("StartLimitBurst")
    (restart_sec,) = _unit_values("RestartSec")
    assert int(burst) * float(restart_sec) < float(interval)
    (nice,) = _unit_values("LimitNICE")
    assert int(nice) <= Config().io_nice


def _quantity(text):
    """Bytes of a Kubernetes memory quantity (binary suffixes)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text)
    assert m, text
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2)]


PROCESS_ALLOWANCE = 1 << 30      # the front, and each worker (MindSpore imported: ~0.4 GiB)


def test_kubernetes_memory_limit_holds_every_workers_budgets(tmp_path):
    """The budgets are per worker (each worker's daemon loads [prefetchd]): the limit was
    one worker's device_budget + host_budget, described as the pod's, with --workers=2."""
    from prefetchd.serve.spec import worker_config
    docs = {d["kind"]: d for d in yaml_documents(KUBE)}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    config = tmp_path / "prefetchd.toml"
    config.write_text(docs["ConfigMap"]["data"]["prefetchd.toml"])
    args = _serve_parser().parse_args(container["args"])
    spec = _check_serve_command(container["args"], config)
    workers = args.workers
    daemons = [worker_config(spec, i, str(tmp_path / f"w{i}")) for i in range(workers)]
    tiers = sum(d.device_budget + (0 if spec.shared_host else d.host_budget) for d in daemons)
    if spec.shared_host:
        tiers += Config.load(str(config), env={}).host_budget
    needed = tiers + (workers + 1) * PROCESS_ALLOWANCE
    resources = container["resources"]
    limit = _quantity(resources["limits"]["memory"])
    assert limit >= needed, (f"memory limit {resources['limits']['memory']} < {needed / 2**30:.1f} GiB "
                             f"for {workers} workers")
    assert _quantity(resources["requests"]["memory"]) == limit
    assert limit < needed + (2 << 30), "far more than the budgets need: update the comment's sums"


# -- example configs

EXAMPLES = sorted((DEPLOY / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_config_uses_known_keys(path):
    from prefetchd.serve.spec import SERVE_OPTIONS
    Config.load(str(path), env={})                     # [prefetchd]: unknown keys raise
    serve = Config.load_section(str(path), "serve")
    unknown = sorted(set(serve) - set(SERVE_OPTIONS))
    assert not unknown, f"{path.name}: [serve] keys prefetchd serve does not know: {unknown}"
    _check_serve_command(["serve"], path)              # and their values are accepted


def test_an_unknown_serve_key_is_caught(tmp_path):
    """The check above can fail: a misspelt [serve] key is refused by `prefetchd serve`."""
    bad = tmp_path / "bad.toml"
    bad.write_text((DEPLOY / "examples" / "serve-config.toml").read_text()
                   .replace("request_timeout", "request_timout"))
    with pytest.raises(ConfigError, match="request_timout"):
        _check_serve_command(["serve"], bad)


# -- Prometheus and Grafana files

def test_prometheus_files_parse_and_agree_with_the_readme():
    config = yaml_documents(DEPLOY / "prometheus" / "prometheus.yml")[0]
    for rule_file in config["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).is_file(), rule_file
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "prefetchd" and job["static_configs"][0]["targets"]
    groups = yaml_documents(DEPLOY / "prometheus" / "alerts.yml")[0]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    for rule in rules:
        assert rule["expr"] and rule["labels"]["severity"] in ("warning", "critical"), rule
        assert rule["annotations"]["summary"], rule
    readme = (DEPLOY / "README.md").read_text()
    documented = set(re.findall(r"^\| `(Prefetchd\w+)` \|", readme, re.M))
    assert documented == {r["alert"] for r in rules}


@pytest.mark.parametrize("kind", ["datasources", "dashboards"])
def test_grafana_provisioning_parses(kind):
    (doc,) = yaml_documents(DEPLOY / "grafana" / "provisioning" / kind / "prefetchd.yml")
    assert doc["apiVersion"] == 1 and doc[kind if kind == "datasources" else "providers"]
