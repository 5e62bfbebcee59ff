"""The README's and the public docstrings' examples, run as written.

Each README example is the README's own text, found by the heading it sits under and executed
in one namespace in the README's order (later examples use earlier names: ``v``, ``bank``,
``dev``). The tests then check what each example claims of its results, so that an example the
package no longer runs, or whose comments no longer describe what it returns, fails here. The
docstrings' examples run as doctests: each states the shapes it returns.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import pathlib
import pkgutil

import pytest
import torch

import sdm_ops
from tests.helpers import make_sdm_inputs, requires_cuda

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


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


def run_examples(namespace: dict, section: str) -> dict:
    blocks = readme_examples().get(section)
    assert blocks, f"README has no Python example under {section!r}"
    for code in blocks:
        exec(compile(code, f"README.md ({section})", "exec"), namespace)
    return namespace


def test_readme_quick_start_layer_compile_and_opcheck_examples_run():
    ns = run_examples({}, "Quick start")
    B, T, H, D, S = (ns[n] for n in ("B", "T", "H", "D", "S"))
    assert ns["out"].shape == (B, T, H, D)
    assert ns["new_bank"].shape == (B, H, S, D)
    assert not ns["bank"].any(), "the functional call modified its input bank"
    assert ns["new_bank"].any()
    val, lin = ns["val"], ns["lin"]
    assert val.shape == lin.shape == (B, T, H, 8) and lin.dtype == torch.int64
    assert (lin.diff(dim=-1) > 0).all(), "top-k slots are not ascending"
    assert ((lin >= 0) & (lin < 256 * 256)).all()

    run_examples(ns, "The layer")
    assert ns["y"].shape == (2, 90, 256) and ns["y_next"].shape == (2, 1, 256)
    assert ns["state"].shape == (2, 4, 64 * 64, 64)

    run_examples(ns, "Compile a model")
    assert ns["loss"].requires_grad
    grads = [p.grad for p in ns["layer"].parameters()]
    assert grads and all(g is not None and g.isfinite().all() for g in grads)
    assert ns["out"].shape == (B, T, H, D) and ns["new_bank"].shape == (B, H, S, D)

    # opcheck raises where the operator fails one of its checks.
    run_examples(ns, "Run opcheck on the operators")


def test_readme_variable_length_example_runs():
    """Its inputs are made as its comment describes them: [1, 4000, ...] and a shared bank."""
    ns = run_examples({}, "Quick start")
    H, D, S, W, R, dev = (ns[n] for n in ("H", "D", "S", "W", "R", "dev"))
    T = 4000
    ns.update(make_sdm_inputs(1, T, H, D, S, W, R, shared=True, device=dev))
    run_examples(ns, "Variable-length batches")
    assert ns["out"].shape == (1, T, H, D)
    banks = ns["banks"]
    assert banks.shape == (3, H, S, D)
    assert torch.equal(banks[1], ns["bank"]), "the empty sequence's bank changed"
    assert not torch.equal(banks[0], ns["bank"]) and not torch.equal(banks[2], ns["bank"])


@requires_cuda
def test_cuda_readme_decode_graph_example_matches_eager_decoding():
    ns = run_examples({}, "Quick start")
    assert ns["dev"] == "cuda"
    run_examples(ns, "Capture a CUDA graph for decoding")
    B, T, H, S, D = (ns[n] for n in ("B", "T", "H", "S", "D"))
    eager = ns["bank"].expand(B, H, S, D).clone()
    for t in range(T):
        last = sdm_ops.sparse_delta_memory_(*ns["step"](t), eager)
    torch.cuda.synchronize()
    assert torch.equal(ns["state"], eager), "the replayed decode's bank differs from eager"
    assert torch.equal(ns["out_t"], last), "the last replay's output differs from eager"


# The public modules whose docstrings give examples (STYLE.md: every public docstring gives a
# runnable example); a module that loses its examples fails its case below.
DOCUMENTED_MODULES = ["sdm_ops.nn", "sdm_ops.product_key", "sdm_ops.recurrence", "sdm_ops.wy"]


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
    tests = doctest.DocTestFinder().find(
        module, extraglobs={"torch": torch, "sdm_ops": sdm_ops})
    assert any(t.examples for t in tests), f"{name} has no docstring example"
    for test in tests:
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples in {name} failed"
