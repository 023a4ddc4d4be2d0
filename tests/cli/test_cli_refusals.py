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
    # A new directory, then the same one again (adding a client), are taken.
    for extra in ((), ("--client", "ops")):
        out = run("keys", str(tmp_path / "keys"), *extra)
        assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    for bad, named in (("", "an empty path"), (str(tmp_path / "loop"), "a symlink to nothing")):
        out = run("keys", bad)
        assert out.returncode in (1, 2) and named in one_error_line(out), out.stderr
