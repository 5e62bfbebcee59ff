"""``python -m benchmarks.bench --plot``: the state section's batch rule, the plot drawn from a
results dict of synthetic timings (the GPU timings themselves are the benchmark's output),
the plot from a ``--json`` file without a GPU, and the refusals."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import _plot, bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_state_batch_halves_b_while_the_bank_passes_8_gib():
    # H=8, D=64, float32: a bank row of the batch is 2 KiB a slot per head, 16 KiB for H=8.
    assert bench.state_batch(8, 4096, 8, 2**16, 64) == (8, 4096)  # 8 GiB / 8 = 1 GiB
    assert bench.state_batch(8, 4096, 8, 2**19, 64) == (8, 4096)  # exactly 8 GiB
    assert bench.state_batch(8, 4096, 8, 2**20, 64) == (4, 8192)
    assert bench.state_batch(8, 4096, 8, 2**22, 64) == (1, 32768)
    assert bench.state_batch(1, 100, 8, 2**24, 64) == (1, 100)  # never below one sequence


def test_the_state_section_runs_its_calls(monkeypatch, capsys):
    """The section on the CPU, small: the real calls of each SDM case run once where the GPU
    timer would time them (the timer replaced by a stand-in that calls and returns fixed
    figures); a failing peer case is noted, not fatal."""
    cpu_workload = bench.make_workload

    def timed(prefix, fn):
        fn()
        return {f"{prefix}_ms": 2.0, f"{prefix}_graph_ms": 1.0}

    def graph_ms(fn):
        fn()
        return 0.5

    def failing_peer(*args, **kwargs):
        raise RuntimeError("no GPU here\nsecond line")

    monkeypatch.setattr(bench, "make_workload", lambda *a, **k: cpu_workload(*a, **k, dev="cpu"))
    monkeypatch.setattr(bench, "timed", timed)
    monkeypatch.setattr(bench._timing, "graph_ms", graph_ms)
    monkeypatch.setattr(bench, "_free", lambda: None)
    monkeypatch.setattr(bench, "STATE_SLOTS", (64, 256))
    monkeypatch.setattr(bench, "STATE_KEY_WIDTHS", (16,))
    monkeypatch.setattr(bench, "_import_peer", lambda module, name: (object(), None))
    monkeypatch.setattr(bench, "_fla_state_row", failing_peer)
    argv = ["--B", "2", "--T", "40", "--H", "2", "--D", "16", "--W", "2", "--R", "2"]
    args = bench.build_parser().parse_args(argv + ["--chunk-size", "16"])
    run = bench.Run(args, [])
    bench.section_state(run)
    (section,) = run.sections
    assert [r["case"] for r in section.rows] == ["sdm S=64", "sdm S=256"]
    assert section.rows[0] == {
        "case": "sdm S=64",
        "kind": "sdm",
        "B": 2,
        "T": 40,
        "state": 64 * 16,
        "fwd_ms": 2.0,
        "fwd_graph_ms": 1.0,
        "in_place_graph_ms": 0.5,
        "fwd_bwd_ms": 2.0,
        "fwd_bwd_graph_ms": 1.0,
    }
    assert section.notes == ["fla K=16 skipped: RuntimeError: no GPU here"]
    assert "sdm S=256" in capsys.readouterr().out


def synthetic_results() -> dict:
    """A results dict as the bench writes it, with made-up timings: SDM at 2^12 to 2^22
    slots (B lowered as the state section does), fla at K = 16 to 256."""
    rows = []
    for i in range(12, 23):
        S = 2**i
        B, T = bench.state_batch(8, 4096, 8, S, 64)
        rows.append(
            {
                "case": f"sdm S={S}",
                "kind": "sdm",
                "B": B,
                "T": T,
                "state": S * 64,
                "fwd_ms": 1.8 + S / 2**20,
                "fwd_graph_ms": 1.7 + S / 2**20,
                "in_place_graph_ms": 1.3,
                "fwd_bwd_ms": 5.1 + S / 2**19,
                "fwd_bwd_graph_ms": 5.0 + S / 2**19,
            }
        )
    for K in (16, 32, 64, 128, 256):
        rows.append(
            {
                "case": f"fla K={K}",
                "kind": "fla",
                "B": 8,
                "T": 4096,
                "state": K * 64,
                "fwd_ms": 0.3 * K / 16,
                "fwd_graph_ms": None,  # a missing graph figure: the eager one is drawn
                "fwd_bwd_ms": 0.8 * K / 16,
                "fwd_bwd_graph_ms": 0.7 * K / 16,
            }
        )
    return {
        "device": "a GPU",
        "sections": [
            {"name": "main", "title": "other", "columns": [], "rows": [{"case": "x"}]},
            {"name": "state", "title": "time per token", "columns": [], "rows": rows},
        ],
    }


def test_plot_state_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "figs" / "state.png"
    assert bench.plot_state(synthetic_results(), str(path)) == str(path)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_plot_state_refuses_results_without_the_section(tmp_path):
    results = synthetic_results()
    del results["sections"][1]
    with pytest.raises(ValueError, match="no 'state' section"):
        bench.plot_state(results, str(tmp_path / "s.png"))
    results = synthetic_results()
    for row in results["sections"][1]["rows"]:
        for key in [k for k in row if k.endswith("_ms")]:
            row[key] = None
    with pytest.raises(ValueError, match="no timings"):
        bench.plot_state(results, str(tmp_path / "s.png"))


def test_plot_from_a_json_file_needs_no_gpu(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = tmp_path / "r.json"
    results.write_text(json.dumps(synthetic_results()))
    path = tmp_path / "state.png"
    assert bench.main(["--plot", str(path), "--from-json", str(results)]) == 0
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert f"plot written to {path}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--from-json", "r.json"], "--from-json needs --plot PATH"),
        (["--plot", "s.png", "--only", "nope"], "unknown section(s) ['nope']"),
    ],
)
def test_refusals(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_matplotlib_plot_exits_2_before_measuring(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert not _plot.available()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--plot", str(tmp_path / "s.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib: pip install 'sdm_ops[plot]'" in err
    with pytest.raises(ImportError, match=r"sdm_ops\[plot\]"):
        bench.plot_state(synthetic_results(), str(tmp_path / "s.png"))
    assert not (tmp_path / "s.png").exists()


def test_plot_alone_runs_the_state_section_and_without_cuda_exits_2(capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--plot", "s.png"])
    assert exit_info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_plot_runs_the_state_section_and_draws_what_it_measured(tmp_path, capsys, monkeypatch):
    """The measuring replaced by synthetic rows (and the GPU by stand-ins): --plot alone runs
    the state section only, --plot with --only adds it, and the PNG is drawn from the run."""
    pytest.importorskip("matplotlib")
    ran = []

    def fake_state(run):
        ran.append("state")
        t = bench.Section(run, "state", "synthetic", [("fwd_ms", "fwd ms", ".3f")])
        for row in synthetic_results()["sections"][1]["rows"]:
            t.add(row.pop("case"), **row)

    monkeypatch.setitem(bench.RUNNERS, "state", fake_state)
    monkeypatch.setitem(bench.RUNNERS, "decode", lambda run: ran.append("decode"))
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(bench._timing, "copy_bandwidth", lambda: 4e12)
    path = tmp_path / "state.png"
    assert bench.main(["--plot", str(path), "--json", str(tmp_path / "r.json")]) == 0
    assert ran == ["state"]
    assert path.read_bytes()[:8] == PNG_MAGIC
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [s["name"] for s in saved["sections"]] == ["state"]
    assert len(saved["sections"][0]["rows"]) == 16
    ran.clear()
    path.unlink()
    assert bench.main(["--plot", str(path), "--only", "decode"]) == 0
    assert ran == ["decode", "state"] and path.exists()
    assert f"plot written to {path}" in capsys.readouterr().out


def test_help_describes_the_plot_and_the_state_section(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    words = " ".join(capsys.readouterr().out.split())
    for text in ("--plot PATH", "--from-json FILE", "``state``: time per token", "2^12 to 2^22"):
        assert text in words
