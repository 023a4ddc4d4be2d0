"""YAML for the deploy tests: parsed by PyYAML, in this interpreter or the system python3's."""
import json
import shutil
import subprocess

import pytest


def yaml_documents(path):
    """Every document of a YAML file, parsed by PyYAML: in this interpreter if it has
    it, else by the system python3's (a real parser either way; no regexes)."""
    try:
        import yaml
        with open(path) as f:
            return [d for d in yaml.safe_load_all(f) if d is not None]
    except ImportError:
        pass
    python = shutil.which("python3", path="/usr/bin:/bin")
    probe = "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]))"
    if python is None or subprocess.run([python, "-c", "import yaml"], capture_output=True).returncode:
        pytest.skip("no YAML parser: neither this interpreter nor /usr/bin/python3 has PyYAML "
                    "(Debian package python3-yaml)")
    out = subprocess.run([python, "-c", probe, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{path} does not parse as YAML:\n{out.stderr}"
    return json.loads(out.stdout)
