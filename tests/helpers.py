"""Shared input makers and comparison helpers for the tests."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from sdm_ops.kernels._common import interpreting, kernels_on_cpu


class Marks(tuple):
    """Several pytest marks as one: a decorator (``@requires_cuda``) that applies them all, and
    a collection that ``pytest.param(..., marks=requires_cuda)`` takes."""

    def __call__(self, obj):
        for mark in reversed(self):
            obj = mark(obj)
        return obj


HAS_CUDA = torch.cuda.is_available()
# Each skip carries its marker (registered in pyproject.toml), so that ``-m cuda`` selects the
# CUDA-only tests and ``-m "not multi_gpu"`` leaves out those that need two GPUs.
requires_cuda = Marks(
    (pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))
)
requires_multi_gpu = Marks(
    (
        pytest.mark.cuda,
        pytest.mark.multi_gpu,
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    )
)
requires_kernels = pytest.mark.skipif(
    not HAS_CUDA and not interpreting(),
    reason="needs a CUDA GPU or TRITON_INTERPRET=1 set before triton is imported",
)

KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root

# The arguments of ``sparse_delta_memory`` (and of the references) in their positional order.
SDM_ORDER = ("v", "beta", "write_idx", "write_w", "read_idx", "read_w", "bank", "decay")
# A small ``SparseDeltaMemory``: factors (4, 4) give 16 slots a head, so tokens often share slots.
SMALL_LAYER = dict(d_model=32, heads=2, head_dim=16, factors=(4, 4), read_topk=3, write_topk=2)


def kernel_modules() -> list:
    """Every module of ``sdm_ops.kernels`` that launches kernels through ``wrap_triton``.
    The others hold shared helpers (modules named ``_...``) or kernels that another module
    launches (``walk_out``'s ``_out_kernel``, launched by ``recurrence_fwd``)."""
    import importlib
    import inspect
    import pkgutil

    import sdm_ops.kernels

    modules = [
        importlib.import_module(f"sdm_ops.kernels.{info.name}")
        for info in pkgutil.iter_modules(sdm_ops.kernels.__path__)
        if not info.name.startswith("_")
    ]
    return [m for m in modules if "wrap_triton(" in inspect.getsource(m)]


@contextlib.contextmanager
def on_kernels():
    """Operators inside launch their Triton kernels: natively on CUDA tensors, under the
    interpreter on CPU tensors."""
    if HAS_CUDA:
        yield
    else:
        with kernels_on_cpu():
            yield


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float,
    name: str = "",
    atol: float | None = None,
) -> None:
    """Relative error against the largest expected magnitude, with a message that says where
    and by how much the tensors differ."""
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    scale = expected.abs().max().item() if expected.numel() else 0.0
    tol = rtol * max(scale, 1.0) if atol is None else atol + rtol * scale
    diff = (actual - expected).abs()
    bad = torch.nan_to_num(diff, nan=float("inf"))
    if bad.numel() and bad.max().item() > tol:
        worst = tuple(int(i) for i in torch.unravel_index(bad.argmax(), bad.shape))
        raise AssertionError(
            f"{name}: max abs diff {bad.max().item():.3e} at {worst} "
            f"(actual {actual[worst].item():.6g}, expected {expected[worst].item():.6g}); "
            f"tolerance {tol:.3e} = rtol {rtol:g} x max(|expected|, 1) {max(scale, 1.0):.3g}"
        )


def run_module(module: str, *args: str, env=None) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` from the repository root, as a user runs it: its output
    captured as text, its exit status returned, not checked."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


class FakeClock:
    """A clock for progress lines: each call returns the next of ``times`` (seconds)."""

    def __init__(self, times):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def capture(fn, warm_up=None):
    """``(graph, result)``: a CUDA graph of one call of ``fn`` and what the call returned
    while captured. Two calls of ``warm_up`` (default ``fn``; one on scratch state where
    ``fn`` would change state the test keeps) run first on a side stream, as
    ``torch.cuda.graph`` requires: Triton compiles, the allocator and cuBLAS set up."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            (warm_up or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def make_sdm_inputs(
    B=2,
    T=37,
    H=2,
    D=16,
    S=11,
    W=3,
    R=2,
    *,
    decay=True,
    shared=False,
    dtype=torch.float32,
    bank_dtype=None,
    index_dtype=torch.int64,
    device="cpu",
    seed=0,
    padding=0.15,
    zero_decay=0.15,
    one_decay=0.15,
):
    """Fresh random arguments of ``sparse_delta_memory`` as a dict.

    Indices are drawn from a small S, so duplicate slots within a token and within a chunk are
    frequent; a ``padding`` fraction of entries is -1; decays in (0, 1) with fractions set to
    exactly 0 and exactly 1. Values, weights and the bank are random normals (never zeros).
    """
    g = torch.Generator().manual_seed(seed)
    bank_dtype = dtype if bank_dtype is None else bank_dtype

    def idx(n):
        i = torch.randint(0, S, (B, T, H, n), generator=g)
        pad = torch.rand(B, T, H, n, generator=g) < padding
        return torch.where(pad, -1, i).to(index_dtype).to(device)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt).to(device)

    args = dict(
        v=rnd(B, T, H, D),
        beta=torch.rand(B, T, H, generator=g).to(dtype).to(device),
        write_idx=idx(W),
        write_w=rnd(B, T, H, W) * 0.5,
        read_idx=idx(R),
        read_w=rnd(B, T, H, R) * 0.5,
        bank=rnd(*(() if shared else (B,)), H, S, D, dt=bank_dtype),
    )
    if decay:
        d = torch.rand(B, T, H, W, generator=g)
        u = torch.rand(B, T, H, W, generator=g)
        d = torch.where(u < zero_decay, 0.0, torch.where(u > 1 - one_decay, 1.0, d))
        args["decay"] = d.to(dtype).to(device)
    return args


def make_packed_sdm_inputs(
    lengths, H=2, D=16, S=11, W=3, R=2, *, shared=False, seed=0, device="cpu", **kw
) -> dict:
    """Arguments of ``sparse_delta_memory`` for sequences of ``lengths`` packed into one
    [1, T] batch, drawn as :func:`make_sdm_inputs` draws them (``kw`` goes to it), with a
    random bank per sequence [N, H, S, D] (or a shared [H, S, D]) and ``cu_seqlens`` (int32)."""
    a = make_sdm_inputs(1, sum(lengths), H, D, S, W, R, seed=seed, device=device, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    bank_shape = (H, S, D) if shared else (len(lengths), H, S, D)
    a["bank"] = torch.randn(*bank_shape, generator=g).to(a["v"].dtype).to(device)
    a["cu_seqlens"] = torch.tensor(
        [0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device
    )
    return a


def sdm_positional(args: dict) -> list:
    """The arguments in ``args`` in the positional order of ``sparse_delta_memory``, with
    ``None`` for an absent one (no decay)."""
    return [args.get(k) for k in SDM_ORDER]


def to_float64(args: dict) -> dict:
    """The same arguments with every floating tensor in float64 on the CPU (the oracle's)."""
    return {
        k: (v.detach().cpu().to(torch.float64) if v.is_floating_point() else v.cpu())
        for k, v in args.items()
    }


def make_wy_inputs(n: int, c: int, seed: int, device="cpu", requires_grad=False):
    """(A, beta, QK), float32: A ~ 0.5 randn / sqrt(C) and beta in (0, 1), so X stays of
    order one; QK ~ randn / sqrt(C)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, c, c, generator=g) * (0.5 / math.sqrt(c))
    beta = torch.rand(n, c, generator=g) * 0.98 + 0.01
    QK = torch.randn(n, c, c, generator=g) / math.sqrt(c)
    return tuple(t.to(device).requires_grad_(requires_grad) for t in (A, beta, QK))


def make_raw(shape, factors, seed: int, device="cpu", dtype=torch.float32, requires_grad=False):
    """Product-key scores [*shape, sum(factors)] with distinct values (no ties)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(*shape, sum(factors), generator=g).to(dtype)
    return raw.to(device).requires_grad_(requires_grad)
