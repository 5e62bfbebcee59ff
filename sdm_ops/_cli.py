"""What the commands' argument parsers share, without torch.

Every command (``python -m sdm_ops.demo``, ``sdm_ops.examples.mqar``, ``sdm_ops.serve``, and
``benchmarks.capacity`` from the repository root) parses its arguments before it imports torch
and the operators, so that ``--help`` and a malformed option answer at once: a parser may use
this module and ``layout``, which import no torch. ``sdm_ops/__init__.py`` loads nothing while
Python locates a command to print its help.
"""

from __future__ import annotations

import argparse
import textwrap

# The recall accuracy the demo and python -m sdm_ops.examples.mqar must reach.
TARGET_ACCURACY = 0.95
STEPS = 600  # their training steps (sdm_ops.examples.mqar: the recipe)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device``, None (resolved after parsing: cuda when available, else cpu) unless given."""
    parser.add_argument(
        "--device",
        default=None,
        help="device to run on (default: cuda if available, else cpu)",
    )


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """The training options shared by ``python -m sdm_ops.examples.mqar`` and ``python -m
    sdm_ops.demo``."""
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=STEPS,
        help=f"training steps, one fresh batch of 32 sequences each (default {STEPS})",
    )
    add_device_option(parser)
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="train the eager model instead of compiling it with torch.compile(fullgraph=True)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model's initialization and of the training batches (default 0)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads of PyTorch's operators (default: PyTorch's own, one "
        "a core); where other processes keep the cores busy, 1 avoids "
        "threads waiting on each other and runs several times faster",
    )
    parser.add_argument(
        "--log-interval",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="seconds between progress lines (default 5)",
    )


def default_device() -> str:
    """``cuda`` where a CUDA GPU is available, else ``cpu`` (imports torch)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, without breaking a hyphenated word ("multi-query") across
    lines, whatever the terminal's width."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(
            text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )
