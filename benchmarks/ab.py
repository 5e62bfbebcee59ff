"""Two revisions of sdm_ops timed side by side on one GPU:
``python benchmarks/ab.py --base REV [--head REV] [--rounds N] [bench options]``.

Each revision's ``sdm_ops`` (and ``benchmarks``) is exported with ``git archive`` into a temporary
folder (the head is the working tree unless ``--head`` names a revision), or, where ``--base``
or ``--head`` names a folder holding an ``sdm_ops`` package, copied from there: on a machine
without git or the repository's history (a GPU host that got a copy of the working tree),
export the base beforehand (``git archive main sdm_ops benchmarks | tar -x -C FOLDER``) and
bring the folder along. Then
``python -m benchmarks.bench`` runs against each in a fresh process whose ``PYTHONPATH`` and
working directory are that copy. Rounds interleave the two (base then head, then head then
base, ...) so that a drift of the GPU's clocks or temperature falls on both. Every option this
script does not know goes to the bench (``--only main``, ``--T 16384``, ...). Both sides run
the head's bench (its ``benchmarks/`` harness copied over the base's), so that only the
library differs; ``--own-bench`` keeps each revision's own (``python -m sdm_ops.bench`` for a
revision older than ``benchmarks/bench.py``).

Printed: per section, every timing (a column in ms or us, floors aside) of every case, the
median over the rounds of each side, and head / base (below 1: the head is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HARNESS = ("__init__.py", "bench.py", "_timing.py", "_plot.py")  # in benchmarks/


def is_timing(key: str) -> bool:
    """A column the comparison holds: a time (``_ms`` or ``_us``) that is not a floor."""
    return key.endswith(("_ms", "_us")) and "floor" not in key


def compare(base_runs: list[dict], head_runs: list[dict]) -> list[dict]:
    """Per section of the runs' results (``--json`` files, one per round), one entry
    ``{"name", "title", "rows": [(case, header, format, base, head, ratio)]}``: the median of
    every timing over the rounds of each side, for the cases and columns both sides hold, and
    the column's format."""

    def medians(runs):
        values: dict[tuple, list[float]] = {}
        for run in runs:
            for s in run["sections"]:
                for row in s["rows"]:
                    for c in s["columns"]:
                        v = row.get(c["key"])
                        if is_timing(c["key"]) and isinstance(v, (int, float)):
                            values.setdefault((s["name"], row["case"], c["key"]), []).append(v)
        return {k: statistics.median(v) for k, v in values.items()}

    base, head = medians(base_runs), medians(head_runs)
    out = []
    for s in head_runs[0]["sections"]:
        rows = []
        for row in s["rows"]:
            for c in s["columns"]:
                key = (s["name"], row["case"], c["key"])
                if key in base and key in head:
                    b, h = base[key], head[key]
                    rows.append(
                        (row["case"], c["header"], c["format"], b, h, h / b if b else float("nan"))
                    )
        if rows:
            out.append({"name": s["name"], "title": s["title"], "rows": rows})
    return out


def render(sections: list[dict], base_label: str, head_label: str) -> str:
    """The comparison as text tables, one per section."""
    lines = []
    for s in sections:
        lines += ["", f"{s['name']}: {s['title']}"]
        width = max(26, *(len(row[0]) + 2 for row in s["rows"]))
        head = (
            f"{'case':<{width}}{'figure':<16}{base_label[:13]:>14}{head_label[:13]:>14}"
            f"{'head/base':>11}"
        )
        lines += [head, "-" * len(head)]
        for case, header, fmt, b, h, ratio in s["rows"]:
            lines.append(f"{case:<{width}}{header:<16}{b:>14{fmt}}{h:>14{fmt}}{ratio:>11.3f}")
    return "\n".join(lines) + "\n"


def git(root: str, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", root, *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def is_tree(rev: str) -> bool:
    """Whether ``rev`` names a folder holding a copy of the package rather than a revision."""
    return os.path.isdir(os.path.join(rev, "sdm_ops"))


def find_root() -> str:
    """The repository's root: git's, or without git the folder above ``benchmarks/``."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return git(here, "rev-parse", "--show-toplevel")
    except (OSError, subprocess.CalledProcessError):
        return os.path.dirname(here)


def describe(root: str, rev: str) -> str:
    """``rev`` for the printed header: a revision's short hash, or the folder's path."""
    return os.path.abspath(rev) if is_tree(rev) else git(root, "rev-parse", "--short", rev)


def export(root: str, rev: str, dest: str) -> None:
    """``git archive REV sdm_ops [benchmarks] | tar -x -C dest`` (``benchmarks`` where REV has
    its bench there), or, where ``rev`` is a folder (``is_tree``), a copy of its ``sdm_ops``
    and ``benchmarks``."""
    if is_tree(rev):
        for name in ("sdm_ops", "benchmarks"):
            if os.path.isdir(os.path.join(rev, name)):
                shutil.copytree(
                    os.path.join(rev, name),
                    os.path.join(dest, name),
                    ignore=shutil.ignore_patterns("__pycache__"),
                )
        return
    os.makedirs(dest)
    paths = ["sdm_ops"]
    has_bench = subprocess.run(
        ["git", "-C", root, "cat-file", "-e", f"{rev}:benchmarks/bench.py"], capture_output=True
    )
    if has_bench.returncode == 0:
        paths.append("benchmarks")
    archive = subprocess.Popen(["git", "-C", root, "archive", rev, *paths], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait():
        raise SystemExit(f"ab.py: git archive {rev} sdm_ops failed")


def run_bench(copy: str, bench_args: list[str], out: str, log: str) -> dict:
    """One bench run against the package in ``copy``: its results (``--json out``). The
    process runs from ``copy`` (``python -m`` puts the working directory first on sys.path)."""
    new = os.path.exists(os.path.join(copy, "benchmarks", "bench.py"))
    module = "benchmarks.bench" if new else "sdm_ops.bench"
    cmd = [sys.executable, "-m", module, *bench_args, "--json", out]
    with open(log, "w") as f:
        done = subprocess.run(
            cmd, check=False, cwd=copy, env=dict(os.environ, PYTHONPATH=copy), stdout=f
        )
    if done.returncode:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise SystemExit(
            f"ab.py: the bench failed in {copy} (exit status {done.returncode}):\n{tail}"
        )
    with open(out) as f:
        results = json.load(f)
    path = os.path.realpath(results["sdm_ops_path"])
    if not path.startswith(os.path.realpath(copy) + os.sep):
        raise SystemExit(f"ab.py: the bench imported {path}, not the copy in {copy}")
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/ab.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base",
        required=True,
        metavar="REV",
        help="the revision to compare against (a commit, branch or tag), or a folder holding "
        "a copy of its sdm_ops (and benchmarks)",
    )
    p.add_argument(
        "--head",
        metavar="REV",
        help="the revision compared, or such a folder (default: the working tree's sdm_ops)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        metavar="N",
        help="bench runs of each side, interleaved (default 2)",
    )
    p.add_argument(
        "--own-bench",
        action="store_true",
        help="run each revision's own bench instead of the head's on both",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="keep every run's results JSON and stdout log in DIR (default: a "
        "temporary folder, removed after)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, bench_args = parser.parse_known_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if any(a == "--json" or a.startswith("--json=") for a in bench_args):
        parser.error("--json is set by ab.py for each run; use --out DIR to keep the results")
    root = find_root()
    labels = {"base": f"base {args.base}", "head": f"head {args.head or 'tree'}"}
    work = tempfile.mkdtemp(prefix="sdm_ab_")
    out = args.out or work
    os.makedirs(out, exist_ok=True)
    try:
        copies = {"base": os.path.join(work, "base"), "head": root}
        export(root, args.base, copies["base"])
        if args.head:
            copies["head"] = os.path.join(work, "head")
            export(root, args.head, copies["head"])
        if not args.own_bench:
            os.makedirs(os.path.join(copies["base"], "benchmarks"), exist_ok=True)
            for name in HARNESS:
                shutil.copy(
                    os.path.join(copies["head"], "benchmarks", name),
                    os.path.join(copies["base"], "benchmarks", name),
                )
        runs: dict[str, list[dict]] = {"base": [], "head": []}
        start = time.perf_counter()
        for r in range(args.rounds):
            for side in ("base", "head") if r % 2 == 0 else ("head", "base"):
                print(
                    f"ab: round {r + 1}/{args.rounds}, {labels[side]} "
                    f"({time.perf_counter() - start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                stem = os.path.join(out, f"{side}-{r + 1}")
                runs[side].append(
                    run_bench(copies[side], bench_args, stem + ".json", stem + ".log")
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first = runs["head"][0]
    print(
        f"{first['device']}: torch {first['torch']}, triton {first['triton']}; "
        f"{labels['base']} = {describe(root, args.base)}, "
        f"{labels['head']}; median of {args.rounds} round(s) each"
    )
    sections = compare(runs["base"], runs["head"])
    if not sections:
        print("no timing that both sides measured (the sections asked take none?)")
        return 1
    sys.stdout.write(render(sections, labels["base"], labels["head"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
