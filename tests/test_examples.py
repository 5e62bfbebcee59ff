"""The README's and the public docstrings' examples, run as written.

Each README example is the README's own text, found by the heading it sits under, and runs as
pasted into a fresh interpreter: a subprocess with nothing imported, so that an example that
forgets an import fails here. In that same process a check of this module then tests what the
example claims of its results, so that an example the package no longer runs, or whose
comments no longer describe what it returns, fails here. An example whose first line says it
needs a CUDA GPU is skipped without one. The README's benchmark table must hold the committed
results' figures, and docs/benchmarks.md every committed table as ``benchmarks/table.py``
renders it. The docstrings' examples run as doctests: each states the shapes it returns.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import json
import os
import pathlib
import pkgutil
import subprocess
import sys

import pytest
import torch

import sdm_ops
from tests.helpers import requires_cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NEEDS_CUDA = "# Needs a CUDA GPU"  # how a README example that needs one begins


@functools.cache
def readme_examples() -> dict[str, list[str]]:
    """The README's ```python blocks by the title of the section they sit in, in order."""
    examples: dict[str, list[str]] = {}
    section, block = None, None
    for line in README.read_text().splitlines(keepends=True):
        if block is not None:
            if line.startswith("```"):
                examples.setdefault(section, []).append("".join(block))
                block = None
            else:
                block.append(line)
        elif line.startswith("```python"):
            block = []
        elif line.startswith("#"):
            section = line.lstrip("#").strip()
    return examples


def run_example(section: str, check, cwd: pathlib.Path = ROOT) -> None:
    """The one Python block under ``section``, run alone in a fresh interpreter (in ``cwd``),
    then ``check(namespace)`` in that process on the names the block made."""
    blocks = readme_examples().get(section)
    assert blocks and len(blocks) == 1, f"README must have one Python example under {section!r}"
    program = (
        "namespace = {'__name__': '__main__'}\n"
        f"exec(compile({blocks[0]!r}, {f'README.md ({section})'!r}, 'exec'), namespace)\n"
        f"from tests.test_examples import {check.__name__}\n"
        f"{check.__name__}(namespace)\n"
    )
    # As a reader runs it: the repository importable for the check alone, and without the
    # Triton interpreter that conftest.py sets for the kernel tests.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=cwd, env=env, capture_output=True, text=True
    )
    if done.returncode < 0 and section == SERVE:
        # The README names PyTorch builds whose AOTInductor kills any process loading a
        # package; skip only where a package of one nn.Linear dies so too.
        from tests.test_export import skip_if_aoti_cannot_load_any_package

        skip_if_aoti_cannot_load_any_package(cwd)
    assert done.returncode == 0, f"README's {section!r} example failed:\n{done.stderr[-4000:]}"


SERVE = "Serve with torch.export / AOTInductor"


def check_train(ns: dict) -> None:
    layer = ns["layer"]
    assert ns["loss"].requires_grad
    grads = {n: p.grad for n, p in layer.named_parameters()}
    assert all(g is not None and g.isfinite().all() for g in grads.values()), grads.keys()
    assert grads["bank"].any(), "the learned initial bank got no gradient"
    assert ns["y"].shape == (2, 128, 256) and ns["state"].shape == (2, 4, 4096, 64)


def check_operators(ns: dict) -> None:
    B, T, H, D, S = (ns[n] for n in ("B", "T", "H", "D", "S"))
    assert ns["out"].shape == (B, T, H, D)
    assert ns["new_bank"].shape == (B, H, S, D)
    assert not ns["bank"].any(), "the functional call modified its input bank"
    assert ns["new_bank"].any()
    val, lin = ns["val"], ns["lin"]
    assert val.shape == lin.shape == (B, T, H, 8) and lin.dtype == torch.int64
    assert (lin.diff(dim=-1) > 0).all(), "top-k slots are not ascending"
    assert ((lin >= 0) & (lin < 256 * 256)).all()


def check_decode_graph(ns: dict) -> None:
    """The replayed decode equals eager decoding, token by token."""
    T, tokens = ns["T"], ns["tokens"]
    eager = torch.zeros_like(ns["state"])
    for t in range(T):
        last = sdm_ops.sparse_delta_memory_(*(x[:, t : t + 1] for x in tokens), eager)
    torch.cuda.synchronize()
    assert torch.equal(ns["state"], eager), "the replayed decode's bank differs from eager"
    assert torch.equal(ns["out_t"], last), "the last replay's output differs from eager"


def check_packed(ns: dict) -> None:
    """Each sequence runs from the shared bank as if alone."""
    banks, bank = ns["banks"], ns["bank"]
    assert ns["out"].shape == (1, 400, 4, 64) and banks.shape == (3, 4, 4096, 64)
    assert torch.equal(banks[1], bank), "the empty sequence's bank changed"
    assert not torch.equal(banks[0], bank) and not torch.equal(banks[2], bank)
    alone = sdm_ops.sparse_delta_memory(
        *(ns[k][:, 120:400] for k in ("v", "beta", "write_idx", "write_w", "read_idx", "read_w")),
        bank,
        output_final_state=True,
    )
    torch.testing.assert_close(banks[2], alone.bank[0])
    torch.testing.assert_close(ns["out"][:, 120:], alone.out)


def check_serve(ns: dict) -> None:
    """The packages decode (the example writes them to the working directory)."""
    assert ns["logits"].shape == (4, 1, 256)
    assert [tuple(s.shape) for s in ns["states"]] == [(4, 2, 256, 32)] * 2
    assert pathlib.Path("prompt.pt2").exists() and pathlib.Path("decode.pt2").exists()


def check_opcheck(ns: dict) -> None:
    """opcheck ran every one of its tests on the operator, and each passed."""
    results = ns["results"]
    assert results and set(results.values()) == {"SUCCESS"}, results


CHECKS = {
    "Train a compiled model": check_train,
    "Call the operators": check_operators,
    "Decode under a CUDA graph": check_decode_graph,
    "Packed variable-length batches": check_packed,
    SERVE: check_serve,
    "Run opcheck": check_opcheck,
}


def test_every_readme_example_is_tested():
    assert set(readme_examples()) == set(CHECKS)


def _needs_cuda(section: str) -> bool:
    return any(block.startswith(NEEDS_CUDA) for block in readme_examples().get(section, []))


@pytest.mark.parametrize(
    "section",
    [pytest.param(s, marks=requires_cuda) if _needs_cuda(s) else s for s in CHECKS],
)
def test_readme_example_runs_as_pasted_and_returns_what_it_says(section, tmp_path):
    run_example(section, CHECKS[section], cwd=tmp_path)


def test_readme_gpu_examples_say_so_in_their_first_line():
    """An example that names the cuda device without falling back to the CPU needs a GPU and
    says so first; every other example runs on the CPU."""
    for section, (block,) in readme_examples().items():
        falls_back = "if torch.cuda.is_available() else" in block
        if '"cuda"' in block and not falls_back:
            assert block.startswith(NEEDS_CUDA), section
        else:
            assert not block.startswith(NEEDS_CUDA), section


RESULTS = ROOT / "benchmarks" / "results"
# The README's summary of the main section of h100.json: its header for each of the bench's keys.
README_SUMMARY = {
    "forward ms": "fwd_graph_ms",
    "in place ms": "in_place_graph_ms",
    "fwd+bwd ms": "fwd_bwd_graph_ms",
    "peak GiB": "peak_gib",
    "fwd+bwd, final state ms": "fwd_bwd_final_graph_ms",
}


def test_readme_benchmark_table_summarizes_the_committed_results():
    results = json.loads((RESULTS / "h100.json").read_text())
    (main,) = [s for s in results["sections"] if s["name"] == "main"]
    formats = {c["key"]: c["format"] for c in main["columns"]}
    lines = [
        "| case | " + " | ".join(README_SUMMARY) + " |",
        "|---|" + "---:|" * len(README_SUMMARY),
    ]
    for row in main["rows"]:
        cells = [format(row[key], formats[key]) for key in README_SUMMARY.values()]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    assert "\n".join(lines) in README.read_text(), "README's table is not h100.json's figures"


@pytest.mark.parametrize("name", ["h100", "h200", "state-h200", "capacity-h200"])
def test_docs_benchmark_tables_are_rendered_from_the_committed_results(name):
    """Every section of each committed results file is in docs/benchmarks.md, its title and
    table as ``benchmarks/table.py`` renders them (the file's notes are not required)."""
    path = RESULTS / f"{name}.json"
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    for section in json.loads(path.read_text())["sections"]:
        rendered = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "table.py"), str(path)]
            + ["--section", section["name"]],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
        provenance, title_and_table = rendered[0], rendered[2 : 6 + len(section["rows"])]
        assert provenance in docs, f"{name}: the provenance line is not in docs/benchmarks.md"
        assert "\n".join(title_and_table) in docs, f"{name}: section {section['name']!r}"


# The public modules whose docstrings give examples (every public docstring gives a runnable
# example); a module that loses its examples fails its case below.
DOCUMENTED_MODULES = [
    "sdm_ops._checks",  # the strict-checks setting
    "sdm_ops.nn",
    "sdm_ops.product_key",
    "sdm_ops.recurrence",
    "sdm_ops.wy",
]


def test_documented_modules_are_every_module_with_examples():
    found = []
    for info in pkgutil.iter_modules(sdm_ops.__path__):
        module = importlib.import_module(f"sdm_ops.{info.name}")
        if any(t.examples for t in doctest.DocTestFinder().find(module)):
            found.append(module.__name__)
    assert found == DOCUMENTED_MODULES


@pytest.mark.parametrize("name", DOCUMENTED_MODULES)
def test_docstring_examples_run_and_print_what_they_show(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner()
    tests = doctest.DocTestFinder().find(module, extraglobs={"torch": torch, "sdm_ops": sdm_ops})
    assert any(t.examples for t in tests), f"{name} has no docstring example"
    for test in tests:
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples in {name} failed"
