"""Fail on development history in the repository's text: git keeps the history.

Scans the git-tracked source and documentation files for what belongs in git log rather than in
code, comments or documents: commit hashes, calendar dates, references to run logs and to
documents outside the repository. Prints ``path:line: text`` for each hit and exits 1 if there
is any, 0 otherwise.

    python tools/check_history.py            # the tracked files
    python tools/check_history.py FILE...    # just these files
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

SUFFIXES = (".py", ".sh", ".md", ".toml", ".cfg", ".txt", ".yml", ".yaml")

# A whole word of 7 to 40 lowercase hex digits holding at least one digit and one letter (a
# commit hash), not part of a 0x literal; an ISO date; names of run logs and outside documents.
PATTERNS = {
    "commit hash": re.compile(
        r"(?<![0-9A-Za-z_.x])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])"
        r"[0-9a-f]{7,40}(?![0-9A-Za-z_])"
    ),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "run log": re.compile(r"PERF_NOTE[S]|GPU_RUN[S]"),
    "outside document": re.compile(r"SPEC sectio[n]|STYLE\.md|SPEC\.md"),
}


def scan_text(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, line) for each line of ``text`` that carries history."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in PATTERNS.items():
            if pattern.search(line):
                hits.append((number, kind, line.strip()))
                break
    return hits


def tracked_files(root: Path) -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    return [root / n for n in names if n.endswith(SUFFIXES)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/check_history.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "files", nargs="*", metavar="FILE", help="files to scan (default: the tracked files)"
    )
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    files = [Path(a) for a in args.files] if args.files else tracked_files(root)
    me = Path(__file__).resolve()
    found = 0
    for path in files:
        if path.resolve() == me or not path.is_file():
            continue
        for number, kind, line in scan_text(path.read_text(errors="replace")):
            print(
                f"{path.relative_to(root) if path.is_absolute() else path}:{number}: "
                f"[{kind}] {line}"
            )
            found += 1
    if found:
        print(
            f"{found} line(s) carry history or cite documents outside the repository; "
            "say what and why instead (git log keeps the history)",
            file=sys.stderr,
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
