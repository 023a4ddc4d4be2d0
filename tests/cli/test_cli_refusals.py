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
