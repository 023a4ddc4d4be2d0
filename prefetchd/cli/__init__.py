"""The `prefetchd` command (entry point prefetchd.cli:main; see prefetchd.cli.main)."""
from .main import build_parser, main

__all__ = ["main", "build_parser"]
