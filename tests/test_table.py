"""benchmarks/table.py (a bench results file as Markdown) and benchmarks/ab.py's comparison,
on small hand-made results."""

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    spec = importlib.util.spec_from_file_location(
        f"benchmarks_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


table = load("table")
ab = load("ab")

RESULTS = {
    "device": "GPU X",
    "torch": "2.0",
    "triton": "3.0",
    "workload": {"B": 2, "T": 8, "H": 1, "D": 4, "S": 16, "W": 1, "R": 1, "chunk_size": 4},
    "copy_bandwidth_bytes_per_s": 2.5e12,
    "sections": [
        {
            "name": "main",
            "title": "two cases",
            "columns": [
                {"key": "fwd_ms", "header": "fwd ms", "format": ".3f"},
                {"key": "fwd_floor_ms", "header": "floor ms", "format": ".3f"},
                {"key": "launches", "header": "launches", "format": "d"},
            ],
            "rows": [
                {"case": "a", "fwd_ms": 1.23456, "fwd_floor_ms": 0.5, "launches": 7},
                {"case": "b", "fwd_ms": None, "fwd_floor_ms": 0.25, "launches": 3},
            ],
            "notes": [],
        },
        {
            "name": "decode",
            "title": "one step",
            "columns": [{"key": "step_graph_us", "header": "replay us", "format": ".1f"}],
            "rows": [{"case": "float32 bank", "step_graph_us": 9.25}],
            "notes": ["peer skipped"],
        },
    ],
}


def test_markdown_of_a_results_file():
    assert table.markdown(RESULTS) == (
        "GPU X, torch 2.0, triton 3.0, B=2 T=8 H=1 D=4 S=16 W=1 R=1 chunk 4, copy bandwidth "
        "2.50 TB/s\n"
        "\n"
        "main: two cases\n"
        "\n"
        "| case | fwd ms | floor ms | launches |\n"
        "|---|---:|---:|---:|\n"
        "| a | 1.235 | 0.500 | 7 |\n"
        "| b |  | 0.250 | 3 |\n"
        "\n"
        "decode: one step\n"
        "\n"
        "| case | replay us |\n"
        "|---|---:|\n"
        "| float32 bank | 9.2 |\n"
        "\n"
        "peer skipped\n"
    )


def test_markdown_of_one_section_and_an_unknown_one():
    text = table.markdown(RESULTS, ["decode"])
    assert "| float32 bank | 9.2 |" in text and "main:" not in text
    with pytest.raises(ValueError, match="nope"):
        table.markdown(RESULTS, ["nope"])


def test_table_command_prints_markdown(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(RESULTS))
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "table.py"),
            str(path),
            "--section",
            "main",
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == table.markdown(RESULTS, ["main"])


def with_fwd(results, *values):
    """A copy of ``results`` whose main section's fwd_ms are ``values``, case by case."""
    r = copy.deepcopy(results)
    for row, v in zip(r["sections"][0]["rows"], values):
        row["fwd_ms"] = v
    return r


def test_ab_compares_the_median_of_each_timing():
    base = [with_fwd(RESULTS, 2.0, 1.0), with_fwd(RESULTS, 4.0, 1.0), with_fwd(RESULTS, 3.0, None)]
    head = [with_fwd(RESULTS, 1.0, None), with_fwd(RESULTS, 2.0, None)]
    head[1]["sections"][1]["rows"][0]["step_graph_us"] = 8.25
    sections = ab.compare(base, head)
    # Floors and counts are no timings; case b has no head timing; the medians: 3.0 against
    # 1.5, 9.25 against 8.75.
    assert sections == [
        {"name": "main", "title": "two cases", "rows": [("a", "fwd ms", ".3f", 3.0, 1.5, 0.5)]},
        {
            "name": "decode",
            "title": "one step",
            "rows": [("float32 bank", "replay us", ".1f", 9.25, 8.75, 8.75 / 9.25)],
        },
    ]
    lines = ab.render(sections, "base main", "head tree").splitlines()
    assert lines[1] == "main: two cases" and "head/base" in lines[2]
    assert lines[4].split() == ["a", "fwd", "ms", "3.000", "1.500", "0.500"]
    assert lines[-1].split() == ["float32", "bank", "replay", "us", "9.2", "8.8", "0.946"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--base", "HEAD", "--json", "x.json"], "--json is set by ab.py"),
        (["--base", "HEAD", "--rounds", "0"], "--rounds must be at least 1"),
        ([], "--base"),
    ],
)
def test_ab_refuses_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ab.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_ab_help_describes_every_option():
    for action in ab.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_ab_takes_folders_for_revisions_without_git(tmp_path, monkeypatch, capsys):
    """``--base`` and ``--head`` may name folders holding a copy of the package (a GPU host has
    no git history): each side runs its own copy of sdm_ops, and the head's bench harness on
    both; the header names the folders."""
    for side in ("base", "head"):
        (tmp_path / side / "sdm_ops").mkdir(parents=True)
        (tmp_path / side / "sdm_ops" / "__init__.py").write_text(f"SIDE = {side!r}\n")
        (tmp_path / side / "benchmarks").mkdir()
        for name in ab.HARNESS:
            (tmp_path / side / "benchmarks" / name).write_text(f"# {side}'s {name}\n")
    seen = []

    def fake_bench(copy_dir, bench_args, out, log):
        with open(os.path.join(copy_dir, "sdm_ops", "__init__.py")) as f:
            package = f.read()
        with open(os.path.join(copy_dir, "benchmarks", "bench.py")) as f:
            harness = f.read()
        seen.append((package, harness, bench_args))
        return with_fwd(RESULTS, 2.0 if "base" in package else 1.0, 1.0)

    monkeypatch.setattr(ab, "run_bench", fake_bench)
    monkeypatch.setattr(ab, "git", lambda *a: (_ for _ in ()).throw(OSError("no git")))
    argv = ["--base", str(tmp_path / "base"), "--head", str(tmp_path / "head"), "--only", "main"]
    assert ab.main(argv) == 0
    # Two rounds, interleaved: base, head, then head, base.
    assert [s[0] for s in seen] == [f"SIDE = {x!r}\n" for x in ("base", "head", "head", "base")]
    assert {s[1] for s in seen} == {"# head's bench.py\n"}
    assert {tuple(s[2]) for s in seen} == {("--only", "main")}
    out = capsys.readouterr().out
    assert f"= {tmp_path / 'base'}" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("a ")]
    assert rows == [["a", "fwd", "ms", "2.000", "1.000", "0.500"]]
