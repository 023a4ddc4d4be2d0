"""deploy/kubernetes/prefetchd-msrun-job.yaml: an Indexed Job whose pods find each other, run msrun
with the right node rank, and stage only their own ranks (the shell scripts run in a real sh)."""
import pathlib
import shlex
import subprocess

from prefetchd import Config
from _yaml import yaml_documents

ROOT = pathlib.Path(__file__).resolve().parents[2]
JOB = ROOT / "deploy" / "kubernetes" / "prefetchd-msrun-job.yaml"


def _run_script(script, env, fake):
    """Run a container's sh script with `fake` (msrun, prefetchd) replaced by echo; its words."""
    for command in fake:
        script = script.replace(f"exec {command} ", f"echo {command} ").replace(f"{command} stage", "echo stage")
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30, check=True)
    return [shlex.split(line) for line in out.stdout.splitlines()]


def test_the_indexed_job_wires_msrun_ranks_and_stores(tmp_path):
    docs = {d["kind"]: d for d in yaml_documents(JOB)}
    assert set(docs) == {"ConfigMap", "Service", "Job"}
    job, service = docs["Job"], docs["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["enableServiceLinks"] is False
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    # msrun resolves --master_addr once: pod 0's name must resolve before it is Ready.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert not service["metadata"]["name"].lower().startswith("prefetchd")
    config = tmp_path / "prefetchd.toml"
    config.write_text(docs["ConfigMap"]["data"]["prefetchd.toml"])
    Config.load(str(config), env={})                          # known keys, values accepted

    (ranks,) = pod["containers"]
    env = {e["name"]: e["value"] for e in ranks["env"]}
    assert int(env["NODES"]) == spec["completions"]
    (argv,) = _run_script(ranks["args"][0], {**env, "JOB_COMPLETION_INDEX": "1"}, ["msrun"])
    opts = dict(zip(argv[1::2], argv[2::2]))
    assert argv[0] == "msrun" and opts["--worker_num"] == str(int(env["NODES"]) * int(env["LOCAL_WORKERS"]))
    assert opts["--node_rank"] == "1"
    assert opts["--master_addr"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    script = argv[argv.index("--log_dir") + 2]
    assert script == "/opt/prefetchd/deploy/msrun/tp_transformer.py"
    assert (ROOT / "deploy" / "msrun" / "tp_transformer.py").is_file()
    mounts = {m["name"]: m["mountPath"] for m in ranks["volumeMounts"]}
    assert env["PREFETCHD_CONFIG"] == f"{mounts['config']}/prefetchd.toml"
    assert argv[argv.index("--store") + 1] == mounts["store"]

    (stage,) = pod["initContainers"]
    stage_env = {e["name"]: e["value"] for e in stage["env"]}
    assert stage_env["LOCAL_WORKERS"] == env["LOCAL_WORKERS"]
    for node in (0, 1):
        staged = _run_script(stage["args"][0], {**stage_env, "JOB_COMPLETION_INDEX": str(node)}, ["prefetchd"])
        # pod `node` stages exactly its own rank into STORE/rank_<rank> (what rank_config opens)
        assert staged == [["stage", f"/checkpoints/rank_{node}/net.ckpt", "--store",
                           f"/var/lib/prefetchd/store/rank_{node}", "--quiet"]]
