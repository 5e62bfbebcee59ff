"""tools/check_history.py: history in tracked text is found, clean text passes."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "check_history.py"
spec = importlib.util.spec_from_file_location("check_history", TOOL)
check_history = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_history)


# The planted lines are assembled at run time so that this file itself carries none of them.
PLANTED = [
    ("# 0.99 ms at " + "986e" + "415, slower", "commit hash"),
    ("see commit " + "2cb5" + "7a9" + "c0ffee for why", "commit hash"),
    ("measured on " + "2026-" + "12-03", "date"),
    ("# see " + "PERF_" + "NOTES 32", "run log"),
    ("its figures are in " + "GPU_" + "RUNS.md", "run log"),
    ('"""Phase 1 (' + "SPEC sec" + 'tion 2)."""', "outside document"),
]


@pytest.mark.parametrize("line,kind", PLANTED)
def test_history_is_found(line, kind):
    hits = check_history.scan_text(f"x = 1\n{line}\n")
    assert hits == [(2, kind, line.strip())]


@pytest.mark.parametrize(
    "line",
    [
        "mask = 0xdeadbeef1",  # a hex literal
        "BLOCK = 1024  # rows a program",
        "def a_b_c1234567(): pass",  # an identifier, not a hash
        "scale = 1e-5; decay = 2**63 - 1",
        "feedface",  # hex letters alone: a word, not a hash
        "1234567890",  # digits alone: a number
    ],
)
def test_clean_text_passes(line):
    assert check_history.scan_text(line) == []


def test_the_tracked_files_carry_no_history():
    assert check_history.main([]) == 0, "run python tools/check_history.py to see the lines"
