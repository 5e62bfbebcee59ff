"""What the benchmark commands' argument parsers share, without torch: they parse their
arguments before they import it, so that ``--help`` and a malformed option answer at once."""

from __future__ import annotations

import argparse


def command_parser(prog: str, doc: str, epilog: str) -> argparse.ArgumentParser:
    """A command's parser: its module docstring as the description, and an epilog about what
    it prints, both with their line breaks kept."""
    return argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=doc,
        epilog=epilog,
    )
