"""tools/suite_ids.py: the tests a cut GPU run left, and the plugin that runs only those."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import suite_ids  # noqa: E402

# Outcome lines end in a space in pytest-xdist's verbose log.
LOG = "\n".join(
    [
        "16 workers [6 items]",
        "tests/test_a.py::test_one[a b] ",
        "[gw3] [ 20%] PASSED tests/test_a.py::test_one[a b] ",
        "[gw1] [ 40%] FAILED tests/test_a.py::test_two ",
        "[gw0] [ 60%] SKIPPED tests/test_b.py::test_three[x] ",
        "tests/test_b.py::test_in_flight[cut here] ",
        "[gw2] [ 80%] ERROR compile_tests/test_c.py::test_four ",
        "tests/test_d.py::test_alone[no workers] PASSED                  [ 90%]",
        "FAILED tests/test_a.py::test_two - AssertionError: 22 ms",
        "FAILED tests/test_e.py::test_summary_only - AssertionError",
    ]
)


def test_reported_holds_every_outcome_with_spaces_and_not_the_tests_in_flight(tmp_path):
    log = tmp_path / "pytest-fast.log"
    log.write_text(LOG)
    assert suite_ids.reported([str(log)]) == {
        "tests/test_a.py::test_one[a b]",
        "tests/test_a.py::test_two",
        "tests/test_b.py::test_three[x]",
        "compile_tests/test_c.py::test_four",
        "tests/test_d.py::test_alone[no workers]",
    }


def test_the_plugin_runs_only_the_listed_tests(tmp_path):
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.parametrize("p", ["a b", "c"])
            def test_p(p):
                pass

            def test_q():
                pass
            """
        )
    )
    ids = tmp_path / "ids.txt"
    ids.write_text("test_x.py::test_p[a b]\ntest_x.py::test_q\n")
    env = dict(
        os.environ,
        SUITE_IDS=str(ids),
        PYTHONPATH=os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]),
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "suite_ids", "-p", "no:cacheprovider", "-v"]
        + ["-p", "no:xdist", "-o", "addopts=", "test_x.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_x.py::test_p[a b] PASSED" in run.stdout
    assert "test_x.py::test_q PASSED" in run.stdout
    assert "test_p[c]" not in run.stdout
    assert "2 passed, 1 deselected" in run.stdout
