"""Every command's ``--help`` prints at once: ``python -m sdm_ops.<command>`` and the scripts
of ``benchmarks/`` and ``tools/`` parse their arguments before they import torch, so the help
costs the interpreter's start and argparse, not the stack's import.

Each command runs in a subprocess as a user runs it, under ``python -X importtime``, whose
report (on stderr) names every module the process imported: none may be torch's. The time
limit is generous for a loaded machine; the import report is the strict check.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HELP_SECONDS = 10.0  # about 0.1 s on an idle machine; importing torch alone takes about 1 s


def entry_points() -> list[tuple[str, ...]]:
    """The command lines of every entry point: the package's modules run with -m, and the
    scripts of benchmarks/ and tools/ (each a file with a ``__main__`` block)."""
    found = []
    for path in sorted([*(ROOT / "sdm_ops").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        text = path.read_text()
        module = path.relative_to(ROOT).with_suffix("").parts
        # The package's commands, and the benchmarks that import their package, run with -m.
        if 'if __name__ == "__main__":' in text and (
            module[0] == "sdm_ops" or "from benchmarks import" in text
        ):
            found.append(("-m", ".".join(module)))
    for folder in ("benchmarks", "tools"):
        for path in sorted((ROOT / folder).glob("*.py")):
            text = path.read_text()
            runs_with_m = folder == "benchmarks" and "from benchmarks import" in text
            if 'if __name__ == "__main__":' in text and not runs_with_m:
                found.append((f"{folder}/{path.name}",))
    return found


def test_the_entry_points_are_the_known_commands():
    assert entry_points() == [
        ("-m", "benchmarks.bench"),
        ("-m", "benchmarks.capacity"),
        ("-m", "sdm_ops.demo"),
        ("-m", "sdm_ops.examples.demo"),
        ("-m", "sdm_ops.examples.mqar"),
        ("-m", "sdm_ops.serve"),
        ("benchmarks/ab.py",),
        ("benchmarks/table.py",),
        ("tools/check_history.py",),
        ("tools/ptxas_report.py",),
        ("tools/sanitize.py",),
        ("tools/suite_ids.py",),
    ]


@pytest.mark.parametrize("command", entry_points(), ids=lambda c: c[-1])
def test_help_prints_without_importing_torch(command):
    # The scripts import from the repository, as with PYTHONPATH=. from its root.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *command, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]
    imported = re.findall(r"^import time:.*\|\s*(\S+)$", done.stderr, flags=re.MULTILINE)
    assert imported, "python -X importtime wrote no import report"
    heavy = [m for m in imported if m.split(".")[0] in ("torch", "triton", "numpy")]
    assert not heavy, f"{' '.join(command)} --help imported {heavy[:5]}"
    assert took < HELP_SECONDS, f"{' '.join(command)} --help took {took:.1f} s"
