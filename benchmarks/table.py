"""A results file of ``python -m benchmarks.bench --json PATH`` as Markdown tables, on stdout:
``python benchmarks/table.py PATH [--section NAME ...]``.

One line says where the figures come from (device, torch, triton, workload, copy bandwidth),
then each section gets its title and a table: the case, then the bench's columns in its
order and formats (a figure the bench did not take is left blank), then the section's notes.
"""

from __future__ import annotations

import argparse
import json
import sys


def provenance(results: dict) -> str:
    """One line: the device, the versions, the workload and the copy bandwidth."""
    w = results.get("workload", {})
    shape = " ".join(f"{k}={w[k]}" for k in ("B", "T", "H", "D", "S", "W", "R") if k in w)
    parts = [
        results.get("device", "unknown device"),
        f"torch {results.get('torch', '?')}",
        f"triton {results.get('triton', '?')}",
    ]
    if shape:
        parts.append(f"{shape} chunk {w.get('chunk_size', '?')}")
    bandwidth = results.get("copy_bandwidth_bytes_per_s")
    if bandwidth:
        parts.append(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    return ", ".join(parts)


def cell(value, fmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return format(value, fmt)


def section_markdown(section: dict) -> list[str]:
    """The lines of one section: its title, its table, its notes."""
    columns = section["columns"]
    lines = [f"{section['name']}: {section['title']}", ""]
    lines.append("| case | " + " | ".join(c["header"] for c in columns) + " |")
    lines.append("|---|" + "---:|" * len(columns))
    for row in section["rows"]:
        cells = [cell(row.get(c["key"]), c["format"]) for c in columns]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    notes = section.get("notes") or []
    if notes:
        lines.append("")
        lines.extend(notes)
    return lines


def markdown(results: dict, sections: list[str] | None = None) -> str:
    """The whole file's Markdown; ``sections`` picks sections by name, in the file's order."""
    known = [s["name"] for s in results["sections"]]
    missing = [s for s in sections or [] if s not in known]
    if missing:
        raise ValueError(f"sections {missing} are not in the results (they hold {known})")
    lines = [provenance(results)]
    for s in results["sections"]:
        if sections is None or s["name"] in sections:
            lines.append("")
            lines.extend(section_markdown(s))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/table.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("results", help="a JSON file written by python -m benchmarks.bench --json")
    parser.add_argument(
        "--section",
        action="append",
        metavar="NAME",
        help="only this section (repeat for more; default: every section)",
    )
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    try:
        sys.stdout.write(markdown(results, args.section))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
