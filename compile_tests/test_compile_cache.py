"""torch.compile's on-disk caches key a compiled graph on the graph Dynamo captured, where an
operator is only its name; sdm_ops adds a hash of its source to the key
(``torch.compiler.config.cache_key_tag``), so that a graph cached for other code of the
package, whose autograd formulas or internal operators may differ, is compiled again."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch._dynamo.utils import counters

import sdm_ops
from sdm_ops.ops._define import source_tag
from tests.helpers import make_wy_inputs


def test_the_package_source_hash_is_in_the_compile_cache_key():
    tags = torch.compiler.config.cache_key_tag.split("+")
    assert sdm_ops.ops.COMPILE_CACHE_TAG in tags
    assert sdm_ops.ops.COMPILE_CACHE_TAG == source_tag(Path(sdm_ops.__file__).parent)


def test_the_source_hash_changes_with_any_file_of_the_package(tmp_path):
    root = Path(sdm_ops.__file__).parent
    copy = tmp_path / "sdm_ops"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_tag(copy) == sdm_ops.ops.COMPILE_CACHE_TAG
    with open(copy / "ops" / "recurrence.py", "a") as f:
        f.write("\n")
    assert source_tag(copy) != sdm_ops.ops.COMPILE_CACHE_TAG
    (copy / "ops" / "recurrence.py").rename(copy / "ops" / "recurrence2.py")
    assert source_tag(copy) != sdm_ops.ops.COMPILE_CACHE_TAG


def _compile_and_run(A, beta, QK):
    """A fresh compile of a loss through ``wy_solve``, forward and backward; returns what
    AOTAutograd's cache did (hits, misses) and the gradient."""
    torch._dynamo.reset()
    counters.clear()
    A = A.clone().requires_grad_()

    @torch.compile(fullgraph=True)
    def loss(A):
        X, QX = sdm_ops.wy_solve(A, beta, QK)
        return X.sum() + QX.square().sum()

    loss(A).backward()
    aot = counters["aot_autograd"]
    return aot["autograd_cache_hit"], aot["autograd_cache_miss"], A.grad


def test_another_source_hash_misses_the_cache_and_this_one_hits(tmp_path, monkeypatch):
    """With the caches in a fresh folder: the first compile misses and stores, the same code
    hits, a tag as another version of the package would have misses. (Config modules are
    patched with their own ``patch``: pytest's monkeypatch deletes their keys on undo.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    A, beta, QK = make_wy_inputs(2, 16, seed=3, device="cpu")
    tag = torch.compiler.config.cache_key_tag
    other = tag.replace(sdm_ops.ops.COMPILE_CACHE_TAG, "sdm_ops-0000000000000000")
    with (
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        hits, misses, first = _compile_and_run(A, beta, QK)
        assert (hits, misses) == (0, 1)
        hits, misses, again = _compile_and_run(A, beta, QK)
        assert (hits, misses) == (1, 0)
        assert torch.equal(first, again)
        with torch.compiler.config.patch(cache_key_tag=other):
            hits, misses, _ = _compile_and_run(A, beta, QK)
        assert (hits, misses) == (0, 1)
    assert torch.compiler.config.cache_key_tag == tag
    torch._dynamo.reset()
