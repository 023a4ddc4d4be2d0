"""A config file that is not one is refused in one line naming it: not UTF-8, nested too
deeply for the TOML parser, a FIFO (which blocked `prefetchd config validate` forever), a
directory. Run as the CLI a user types, each bounded in time."""
import os
import subprocess
import sys

import pytest

from helpers import ENV


def _validate(path):
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "config", "validate", "--config", str(path)],
                         env=ENV, capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    return out.returncode, lines


@pytest.mark.parametrize("case", ["not_utf8", "deeply_nested", "fifo", "directory"])
def test_a_file_that_is_no_config_is_refused_in_one_line_naming_it(tmp_path, case):
    path = tmp_path / "prefetchd.toml"
    if case == "not_utf8":
        path.write_bytes(b'name = "\xff\xfe"\n')
        want = "not UTF-8"
    elif case == "deeply_nested":
        path.write_text("x = " + "[" * 100000 + "]" * 100000 + "\n")
        want = "nested too deeply"
    elif case == "fifo":
        os.mkfifo(path)
        want = "not a regular file"
    else:
        path.mkdir()
        want = "not a regular file"
    code, lines = _validate(path)
    assert code != 0 and len(lines) == 1, lines
    assert str(path) in lines[0] and want in lines[0], lines
