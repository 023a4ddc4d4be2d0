"""What the benchmark modules share (below runner, which dispatches to them)."""
import argparse
import os


def run_from_python(run, directory, defaults, options):
    """A benchmark's Python entry point: `run(directory, args)` with `options` (the
    CLI flags' names) over `defaults`; an option the benchmark lacks is a TypeError."""
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(defaults)}")
    os.makedirs(directory, exist_ok=True)
    return run(directory, argparse.Namespace(**{**defaults, **options}))


def cpu_seconds(stat_path):
    """User + system CPU seconds from a /proc stat file: /proc/<pid>/stat (the process,
    all its threads) or /proc/self/task/<tid>/stat (one thread)."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
