"""A real Prometheus server scrapes a daemon under load using deploy/prometheus/;
every PromQL expression of the dashboard and of the alert rules must parse and
return data.

Skips when no `prometheus` binary is installed, except under CI (env CI set),
where a skip would hide a broken deploy config: then it fails.
"""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import select
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "prometheus"
PROM_CONFIG = DEPLOY / "prometheus.yml"
ALERTS = DEPLOY / "alerts.yml"
DASHBOARD = ROOT / "dashboards" / "prefetchd.json"
LOAD_SCRIPT = Path(__file__).resolve().parents[1] / "_load_daemon.py"
RATE_INTERVAL = "15s"
# Alerts a healthy daemon under load never even starts (pending) -- the load-
# dependent ones (stalls, refused prefetches) may, and wait out their `for:`.
MUST_STAY_INACTIVE = {"PrefetchdWatermarkBreached", "PrefetchdChecksumFailures", "PrefetchdIOErrors",
                      "PrefetchdExporterDown"}

pytestmark = pytest.mark.slow


def _binary(name):
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"`{name}` is not installed but CI is set: this test must run in CI")
        pytest.skip(f"`{name}` not installed (Debian package `prometheus`)")
    return found


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base, path, **params):
    url = f"{base}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:   # 400/422 carry the PromQL error as JSON
        return json.loads(e.read())


def _wait(what, predicate, timeout, interval=0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (OSError, ValueError) as e:
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def _stop(proc, timeout=10):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def rewrite_config(text, target, rules_path, interval="1s"):
    """deploy/prometheus/prometheus.yml, pointed at `target`, scraping every `interval`."""
    subs = [
        (r'(?m)^(\s*- targets:\s*)\[[^\]]*\]', rf'\g<1>["{target}"]'),
        (r'(?m)^(\s*)scrape_interval:\s*\S+', rf'\g<1>scrape_interval: {interval}'),
        (r'(?m)^(\s*)evaluation_interval:\s*\S+', rf'\g<1>evaluation_interval: {interval}'),
        (r'(?m)^(\s*)scrape_timeout:\s*\S+', rf'\g<1>scrape_timeout: {interval}'),
        (r'(?m)^(\s*- )alerts\.yml\s*$', rf'\g<1>{rules_path}'),
    ]
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text)
        assert n >= 1, f"prometheus.yml no longer matches {pattern!r}: update the test or the file"
    return text


def dashboard_queries():
    """[(panel title, expr)] for every target of every panel, rows included."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for q in [p, *p.get("panels", [])]:
            for t in q.get("targets", []):
                out.append((q["title"], t["expr"]))
    return out, dash["templating"]["list"]


def substitute(expr, instance, daemon):
    expr = (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", "5s")
            .replace("$__range", "5m").replace("${instance}", instance).replace("$instance", instance)
            .replace("${daemon}", daemon).replace("$daemon", daemon))
    assert "$" not in expr, f"unsubstituted template variable in {expr!r}"
    return expr


def alert_rules():
    """[(alert name, expr)] from alerts.yml (one-line exprs, as promtool checks them)."""
    text = ALERTS.read_text()
    names = re.findall(r"^\s*- alert:\s*(\S+)", text, re.M)
    exprs = re.findall(r"^\s*expr:\s*(.+?)\s*$", text, re.M)
    assert len(names) == len(exprs) and names
    return list(zip(names, exprs))


def without_threshold(expr):
    """The left operand of the top-level comparison (`a > ignoring(x) b` -> `a`), or None."""
    depth, quote = 0, None
    for i, ch in enumerate(expr):
        if quote:
            if ch == quote and expr[i - 1] != "\\":
                quote = None
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and (expr[i:i + 2] in (">=", "<=", "==", "!=") or ch in "<>"):
            return expr[:i].strip()
    return None


def test_without_threshold():
    assert without_threshold('up{job="prefetchd"} == 0') == 'up{job="prefetchd"}'
    assert without_threshold('a{x=~"y"} > ignoring(level) b{level="high"}') == 'a{x=~"y"}'
    assert without_threshold('sum by (a) (rate(x[5m])) > 0.25') == 'sum by (a) (rate(x[5m]))'
    assert without_threshold('x{a!="b"} >= 1') == 'x{a!="b"}'
    assert without_threshold('sum(x)') is None


class LoadDaemon:
    def __init__(self, port, proc, log_path):
        self.port, self.proc, self.log_path = port, proc, log_path

    def describe(self):
        state = "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
        return f"load daemon {state}; its log ends with:\n{self.log_path.read_text()[-3000:]}"


@pytest.fixture
def load_daemon(tmp_path):
    """A subprocess running a daemon under load; yields its metrics port."""
    import prefetchd   # the subprocess imports the same prefetchd (source tree or installed) as we do
    pkg_root = str(Path(prefetchd.__file__).resolve().parent.parent)
    stderr = open(tmp_path / "load.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(LOAD_SCRIPT), "--store-dir", str(tmp_path / "store"), "--port", "0",
         "--seconds", "120", "--name", "load"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
        text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": pkg_root + os.pathsep +
                                       os.environ.get("PYTHONPATH", "")})
    try:
        line = _wait("the load daemon's metrics port", lambda: _readline(proc, tmp_path / "load.log"), 60,
                     interval=0)
        yield LoadDaemon(json.loads(line)["port"], proc, tmp_path / "load.log")
    finally:
        if proc.stdin:
            proc.stdin.close()
        _stop(proc)
        proc.stdout.close()
        stderr.close()


def _readline(proc, log_path):
    ready, _, _ = select.select([proc.stdout], [], [], 0.5)
    if ready:
        line = proc.stdout.readline()
        if line:
            return line
    if proc.poll() is not None:
        raise AssertionError(f"load daemon exited with {proc.returncode} before reporting its port:\n"
                             + log_path.read_text()[-3000:])
    return None


def test_promtool_checks_deploy_files():
    promtool = _binary("promtool")
    for args in (["check", "config", str(PROM_CONFIG)], ["check", "rules", str(ALERTS)]):
        r = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


@contextlib.contextmanager
def prometheus_scraping(tmp_path, target):
    """A real Prometheus running deploy/prometheus/ (every second) against `target`; its base URL."""
    prometheus = _binary("prometheus")
    promtool = _binary("promtool")
    config = tmp_path / "prometheus.yml"
    config.write_text(rewrite_config(PROM_CONFIG.read_text(), target, ALERTS))
    r = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

    port = _free_port()
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    proc.log_path = tmp_path / "prometheus.log"
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        _stop(proc)
        log.close()


def _target_up(base, proc, target, daemon):
    if proc.poll() is not None:
        raise AssertionError(f"prometheus exited: {proc.log_path.read_text()}")
    if daemon.proc.poll() is not None:
        raise AssertionError(daemon.describe())
    active = _get(base, "/api/v1/targets")["data"]["activeTargets"]
    return [t for t in active if t["scrapeUrl"].startswith(f"http://{target}/") and t["health"] == "up"]


def test_dashboard_and_alert_queries_against_real_prometheus(tmp_path, load_daemon):
    target = f"127.0.0.1:{load_daemon.port}"
    with prometheus_scraping(tmp_path, target) as (base, proc):
        _wait("prometheus to scrape the daemon", lambda: _target_up(base, proc, target, load_daemon), 40)
        # rate() over RATE_INTERVAL needs two samples; wait for a few scrapes and
        # for the load to have moved bytes between two of them.
        _wait("five scrapes", lambda: _scalar(base, f'count_over_time(up{{instance="{target}"}}[1m])') >= 5, 30)
        _wait("load traffic between scrapes",
              lambda: _scalar(base, f'sum(increase(prefetchd_transfer_bytes_total{{instance="{target}"}}[{RATE_INTERVAL}]))') > 0, 20)

        failures = []
        queries, variables = dashboard_queries()
        assert len(queries) >= 20
        for title, raw in queries:
            expr = substitute(raw, target, "load")
            res = _get(base, "/api/v1/query", query=expr)
            if res.get("status") != "success":
                failures.append(f"[{title}] {expr}: {res.get('errorType')}: {res.get('error')}")
            elif not res["data"]["result"] and "prefetchd_serve_" not in expr:
                # The target is a daemon; the serving panels' series come from a
                # `prefetchd serve` front (tests/telemetry/test_metrics.py checks they exist).
                failures.append(f"[{title}] {expr}: empty result")
        # Template variables: label_values(metric, label) is Grafana's; ask the series API.
        for var in variables:
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var.get("definition", ""))
            if not m:
                continue
            match = substitute(m.group(1), target, "load")
            res = _get(base, f"/api/v1/label/{m.group(2)}/values", **{"match[]": match})
            if res.get("status") != "success" or not res["data"]:
                failures.append(f"[variable {var['name']}] {var['definition']}: {res}")

        rules = alert_rules()
        for name, expr in rules:
            res = _get(base, "/api/v1/query", query=expr)
            if res.get("status") != "success":
                failures.append(f"[alert {name}] {expr}: {res.get('errorType')}: {res.get('error')}")
                continue
            left = without_threshold(expr)
            assert left, f"alert {name}: no threshold found in {expr!r}"
            res = _get(base, "/api/v1/query", query=left)
            # (a serve front's series: test_a_serve_worker_down_is_matched_by_its_alert)
            if res.get("status") != "success" or not res["data"]["result"] and "prefetchd_serve_" not in expr:
                failures.append(f"[alert {name} without threshold] {left}: {res}")
        assert not failures, "\n".join([*failures, load_daemon.describe()])

        # The rule manager loaded and evaluated every rule without error, and the
        # healthy daemon fires none of them (a watermark breach must be impossible).
        def evaluated():
            groups = _get(base, "/api/v1/rules")["data"]["groups"]
            got = [r for g in groups for r in g["rules"]]
            if len(got) == len(rules) and all(not r["lastEvaluation"].startswith("0001") for r in got):
                return got
            return None
        got = _wait("every alert rule to be evaluated", evaluated, 15)
        for rule in got:
            assert rule["health"] == "ok", rule
            assert not rule.get("lastError"), rule
            if rule["name"] in MUST_STAY_INACTIVE:
                assert rule["state"] == "inactive", rule
        assert {r["name"] for r in got} == {n for n, _ in rules}


def test_a_serve_worker_down_is_matched_by_its_alert(tmp_path):
    """PrefetchdServeWorkerDown against a real `prefetchd serve` front, one of whose two
    workers was killed with respawn off (as one given up is): Prometheus finds that worker
    down and the alert is pending (it fires after its 10 minutes); the live one matches not."""
    from prefetchd.serve import Front, ServeSpec
    spec = ServeSpec(models=1, hidden=32, layers=2, seq=4, store_dir=str(tmp_path / "store"))
    front = Front(f"ipc://{tmp_path}/alert.sock", workers=2, spec=spec, name=f"alert{os.getpid()}",
                  metrics_port=0, respawn=False).start()
    try:
        os.kill(front.snapshot()["workers"][1]["pid"], signal.SIGKILL)
        _wait("the front to see its worker die", lambda: not front.snapshot()["workers"][1]["ready"], 30)
        target = f"127.0.0.1:{front.metrics_port}"
        with prometheus_scraping(tmp_path, target) as (base, prom):
            def pending():
                if prom.poll() is not None:
                    raise AssertionError(f"prometheus exited: {prom.log_path.read_text()}")
                alerts = _get(base, "/api/v1/alerts")["data"]["alerts"]
                return [a for a in alerts if a["labels"]["alertname"] == "PrefetchdServeWorkerDown"]
            (alert,) = _wait("the worker-down alert to be pending", pending, 40)
            assert alert["labels"]["worker"] == "1" and alert["state"] == "pending", alert
    finally:
        front.close(10)


def _scalar(base, expr):
    res = _get(base, "/api/v1/query", query=expr)
    assert res.get("status") == "success", res
    result = res["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


FAULTED_DAEMON = """
import errno, json, os, sys
import numpy as np, mindspore as ms
import prefetchd
from prefetchd import _native
daemon = prefetchd.Daemon(device_budget="8MiB", store_dir=sys.argv[1], metrics_port=0, name="faulted")
with daemon:
    weights = [ms.Parameter(ms.Tensor(np.ones((64, 64), np.float32)), name=f"w{i}") for i in range(2)]
    daemon.register_all(weights, tier="remote")
    for name, fault in zip(daemon.names(), [dict(kind="bitflip"), dict(kind="error", err=errno.EIO)]):
        _native.inject_fault("read", fault.pop("kind"), nth=1, count=1, **fault)
        try:
            daemon.prefetch(name).result(30)
        except prefetchd.PrefetchdError as e:
            print(type(e).__name__, e, file=sys.stderr, flush=True)
    print(json.dumps({"port": daemon.metrics_port, "pid": os.getpid()}), flush=True)
    sys.stdin.read()
"""


def test_failures_counted_before_the_first_scrape_fire_their_alerts(tmp_path):
    """A checksum failure and a read error that happen before Prometheus first scrapes the
    daemon (it reads its model as it starts; a serve front exports once its workers are up):
    their counters' first samples are 1, and increase() over them stays 0, so the alerts that
    used increase() alone never fired. Both fire now, from the shipped alerts.yml."""
    import prefetchd
    pkg_root = str(Path(prefetchd.__file__).resolve().parent.parent)
    script = tmp_path / "faulted.py"
    script.write_text(FAULTED_DAEMON)
    stderr = open(tmp_path / "faulted.log", "w")
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "store")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": pkg_root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    daemon = LoadDaemon(None, proc, tmp_path / "faulted.log")
    try:
        line = _wait("the faulted daemon's metrics port", lambda: _readline(proc, daemon.log_path), 60, interval=0)
        target = f"127.0.0.1:{json.loads(line)['port']}"
        with prometheus_scraping(tmp_path, target) as (base, prom):
            _wait("prometheus to scrape the daemon", lambda: _target_up(base, prom, target, daemon), 40)
            assert _scalar(base, f'sum(prefetchd_checksum_failures_total{{instance="{target}"}})') == 1
            assert _scalar(base, f'sum(prefetchd_io_errors_total{{instance="{target}",op="read"}})') >= 1

            def firing():
                alerts = _get(base, "/api/v1/alerts")["data"]["alerts"]
                names = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
                return names if {"PrefetchdChecksumFailures", "PrefetchdIOErrors"} <= names else None
            firing_now = _wait("both alerts to fire", firing, 20)
            assert "PrefetchdWatermarkBreached" not in firing_now
    finally:
        proc.stdin.close()
        _stop(proc)
        proc.stdout.close()
        stderr.close()
