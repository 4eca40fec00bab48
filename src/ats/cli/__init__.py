"""The `ats` command line (see `ats.cli.main`)."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
