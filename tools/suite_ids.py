"""Run the GPU suite in parts that each fit a time limit: the tests no earlier run reported.

    python tools/suite_ids.py rest [--part fast] LOG... > ids.txt
    IDS=ids.txt bash tools/gpu_suite.sh fast

``rest`` collects the part's tests here (collection needs no GPU: the CUDA tests are collected
everywhere and skip at run time) and prints, one a line, the id of each test that none of the
logs reports as passed, failed, skipped or errored. The logs are ``gpu_suite.sh``'s verbose ones
(``$OUT/pytest-PART.log``), so a run cut by its time limit is taken up where it stopped, the
tests it left in flight included. Test ids may hold spaces, which is why the list goes through
a file rather than pytest's command line.

The same file is the pytest plugin that ``gpu_suite.sh`` loads with ``IDS``: with the
environment variable ``SUITE_IDS`` naming such a file, only the tests it lists run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The marker expression of each part, as in tools/gpu_suite.sh.
PARTS = {
    "all": "not multi_gpu",
    "fast": "not slow and not multi_gpu",
    "slow": "slow and not multi_gpu",
    "multi_gpu": "multi_gpu",
}
# A verbose log's report of one test, with workers ("[gw3] [ 80%] PASSED tests/x.py::name[a b]")
# and without ("tests/x.py::name[a b] PASSED [ 80%]"); not the summary's "FAILED id - reason".
_OUTCOME = r"(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
_ID = r"((?:tests|compile_tests)/\S[^\n]*?)"
REPORTED = (
    re.compile(rf"^\[gw\d+\] \[ *\d+%\] {_OUTCOME} {_ID} *$", re.M),
    re.compile(rf"^{_ID} {_OUTCOME}(?: +\[ *\d+%\])? *$", re.M),
)


def reported(logs: list[str]) -> set[str]:
    """The ids of the tests the logs report an outcome for."""
    texts = [Path(log).read_text(errors="replace") for log in logs]
    return {m for text in texts for pattern in REPORTED for m in pattern.findall(text)}


def collected(part: str) -> list[str]:
    """The ids of the part's tests, collected here without running them."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", PARTS[part], "tests", "compile_tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    if run.returncode != 0 or not ids:
        sys.exit(f"suite_ids.py: collecting the {part} tests failed:\n{run.stdout}{run.stderr}")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/suite_ids.py",
        description=__doc__.split("\n\n")[0],
        epilog="With IDS=FILE, bash tools/gpu_suite.sh PART runs only the tests listed in FILE "
        "(which must travel with the repository: not ignored by git, or carried).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rest = sub.add_parser("rest", help="print the ids of the tests no log reports")
    rest.add_argument("--part", choices=sorted(PARTS), default="fast", help="default: fast")
    rest.add_argument("logs", nargs="+", metavar="LOG", help="gpu_suite.sh's verbose logs")
    args = parser.parse_args(argv)
    done = reported(args.logs)
    left = [i for i in collected(args.part) if i not in done]
    sys.stdout.write("".join(f"{i}\n" for i in left))
    print(f"suite_ids.py: {len(left)} tests left to run", file=sys.stderr)
    return 0


def pytest_collection_modifyitems(config, items):
    """Keep only the tests the file named by ``SUITE_IDS`` lists (the plugin's one hook)."""
    path = os.environ.get("SUITE_IDS")
    if not path:
        return
    wanted = set(Path(path).read_text().splitlines())
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
    items[:] = [i for i in items if i.nodeid in wanted]


if __name__ == "__main__":
    sys.exit(main())
