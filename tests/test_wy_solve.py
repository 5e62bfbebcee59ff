"""The WY-solve kernels (``sdm_ops.kernels.wy_solve``) against the float64 reference.

Kernel results come from ``sdm_ops.wy_solve`` and autograd through it inside ``on_kernels()``
(natively on CUDA, under the Triton interpreter on CPU); the oracle is ``wy_solve_reference``
(and autograd through it) on float64 CPU copies. Relative error <= 1e-5 of the largest expected
magnitude, as the numerical contract asks for float32.
"""

from __future__ import annotations

import math

import pytest
import torch

import sdm_ops
from sdm_ops.kernels import wy_solve as wy_kernels
from sdm_ops.reference import wy_solve_backward_reference, wy_solve_reference
from tests.helpers import (
    HAS_CUDA,
    KERNEL_DEVICE,
    assert_close,
    on_kernels,
    requires_cuda,
    requires_kernels,
)

CHUNK_SIZES = (1, 5, 16, 33, 64, 100, 128)
N_CHUNKS = 512 if HAS_CUDA else 2  # the interpreter is slow
RTOL = 1e-5


def make_inputs(n: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, beta, QK) on CPU, float32: A ~ 0.5 randn / sqrt(C) and beta in (0, 1), so that
    X = (I + tril(beta A, -1))^-1 stays of order one; QK ~ randn / sqrt(C)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, c, c, generator=g) * (0.5 / math.sqrt(c))
    beta = torch.rand(n, c, generator=g) * 0.98 + 0.01
    QK = torch.randn(n, c, c, generator=g) / math.sqrt(c)
    return A, beta, QK


def make_sparse_inputs(
    n: int, c: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, beta, QK) as a large bank makes them: a few nonzero entries a chunk (most 16 x 16
    tiles zero), chunk 0 all zero, chunk 1 dense, the others 1 to 6 entries each of A and QK at
    random places of their triangles."""
    g = torch.Generator().manual_seed(seed)
    A_dense, beta, QK_dense = make_inputs(n, c, seed)
    A = torch.zeros(n, c, c)
    QK = torch.zeros(n, c, c)
    for k in range(2, n):
        for dst, src in ((A, A_dense), (QK, QK_dense)):
            count = int(torch.randint(1, 7, (), generator=g))
            i = torch.randint(0, c, (count,), generator=g)
            j = (torch.rand(count, generator=g) * (i + 1)).long().clamp(max=c - 1)
            dst[k, i, j] = src[k, i, j]
    if n > 1:
        A[1], QK[1] = A_dense[1], QK_dense[1]
    return A, beta, QK


def make_output_grads(n: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, dQX) on CPU, float32, dense (the upper triangles too)."""
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(n, c, c, generator=g), torch.randn(n, c, c, generator=g)


def kernel_solve(A, beta, QK):
    with on_kernels():
        X, QX = sdm_ops.wy_solve(A.to(KERNEL_DEVICE), beta.to(KERNEL_DEVICE), QK.to(KERNEL_DEVICE))
    return X.cpu(), QX.cpu()


def kernel_grads(A, beta, QK, dX, dQX):
    """(dA, dbeta, dQK) by autograd through ``sdm_ops.wy_solve`` on the kernels."""
    inputs = [t.to(KERNEL_DEVICE).requires_grad_() for t in (A, beta, QK)]
    with on_kernels():
        X, QX = sdm_ops.wy_solve(*inputs)
        grads = torch.autograd.grad((X, QX), inputs, (dX.to(KERNEL_DEVICE), dQX.to(KERNEL_DEVICE)))
    return tuple(t.cpu() for t in grads)


def reference_grads(A, beta, QK, dX, dQX):
    """(dA, dbeta, dQK) by float64 autograd through ``wy_solve_reference``."""
    inputs = [t.detach().double().requires_grad_() for t in (A, beta, QK)]
    X, QX = wy_solve_reference(*inputs)
    return torch.autograd.grad((X, QX), inputs, (dX.double(), dQX.double()))


def assert_exact_zero_above(t: torch.Tensor, diagonal: int, name: str) -> None:
    """t is +0.0 (not -0.0) on the diagonals >= ``diagonal`` of each chunk."""
    upper = torch.triu(t, diagonal)
    assert not upper.any() and not torch.signbit(upper).any(), (
        f"{name}: not +0.0 on and above diagonal {diagonal}"
    )


@requires_kernels
@pytest.mark.parametrize("c", CHUNK_SIZES)
def test_forward_matches_float64_reference_with_exact_zeros_above_diagonal(c):
    A, beta, QK = make_inputs(N_CHUNKS, c, seed=c)
    X, QX = kernel_solve(A, beta, QK)
    rX, rQX = wy_solve_reference(A.double(), beta.double(), QK.double())
    assert X.dtype == QX.dtype == torch.float32 and X.is_contiguous() and QX.is_contiguous()
    assert_close(X, rX, rtol=RTOL, name=f"X (C={c})")
    assert_close(QX, rQX, rtol=RTOL, name=f"QX (C={c})")
    assert_exact_zero_above(X, 1, "X")
    assert_exact_zero_above(QX, 1, "QX")
    assert torch.equal(torch.diagonal(X, dim1=1, dim2=2), torch.ones(N_CHUNKS, c))


@requires_kernels
@pytest.mark.parametrize("c", CHUNK_SIZES)
def test_backward_matches_float64_autograd_of_reference(c):
    A, beta, QK = make_inputs(N_CHUNKS, c, seed=100 + c)
    dX, dQX = make_output_grads(N_CHUNKS, c, seed=100 + c)
    dA, dbeta, dQK = kernel_grads(A, beta, QK, dX, dQX)
    rA, rbeta, rQK = reference_grads(A, beta, QK, dX, dQX)
    assert_close(dA, rA, rtol=RTOL, name=f"dA (C={c})")
    assert_close(dbeta, rbeta, rtol=RTOL, name=f"dbeta (C={c})")
    assert_close(dQK, rQK, rtol=RTOL, name=f"dQK (C={c})")
    assert_exact_zero_above(dA, 0, "dA")
    assert_exact_zero_above(dQK, 1, "dQK")


@requires_kernels
@pytest.mark.parametrize("c", (33, 128))
def test_backward_operator_matches_backward_reference(c):
    """``sdm_internal::wy_solve_backward`` on the kernels against the closed-form backward
    reference."""
    A, beta, QK = make_inputs(N_CHUNKS, c, seed=200 + c)
    dX, dQX = make_output_grads(N_CHUNKS, c, seed=200 + c)
    X, _ = kernel_solve(A, beta, QK)
    dev = [t.to(KERNEL_DEVICE) for t in (A, beta, QK, X, dX, dQX)]
    with on_kernels():
        got = torch.ops.sdm_internal.wy_solve_backward(*dev)
    want = wy_solve_backward_reference(*(t.double() for t in (A, beta, QK, X, dX, dQX)))
    for name, g, w in zip(("dA", "dbeta", "dQK"), got, want):
        assert_close(g.cpu(), w, rtol=RTOL, name=f"{name} (C={c})")


@requires_kernels
def test_unread_triangles_may_hold_nan():
    """NaN in every element the contract says is not read (A on and above the diagonal, QK above
    it, dX on and above it, dQX above it) changes no output or gradient."""
    n, c = N_CHUNKS, 33
    A, beta, QK = make_inputs(n, c, seed=7)
    dX, dQX = make_output_grads(n, c, seed=7)
    nan = torch.tensor(math.nan)
    A_bad = torch.where(torch.ones(c, c, dtype=torch.bool).triu(0), nan, A)
    QK_bad = torch.where(torch.ones(c, c, dtype=torch.bool).triu(1), nan, QK)
    dX_bad = torch.where(torch.ones(c, c, dtype=torch.bool).triu(0), nan, dX)
    dQX_bad = torch.where(torch.ones(c, c, dtype=torch.bool).triu(1), nan, dQX)

    X, QX = kernel_solve(A_bad, beta, QK_bad)
    rX, rQX = wy_solve_reference(A.double(), beta.double(), QK.double())
    assert_close(X, rX, rtol=RTOL, name="X")
    assert_close(QX, rQX, rtol=RTOL, name="QX")

    dA, dbeta, dQK = kernel_grads(A_bad, beta, QK_bad, dX_bad, dQX_bad)
    # The unread gradient entries reach nothing: the reference gets zeros there.
    rA, rbeta, rQK = reference_grads(A, beta, QK, torch.tril(dX, -1), torch.tril(dQX))
    assert_close(dA, rA, rtol=RTOL, name="dA")
    assert_close(dbeta, rbeta, rtol=RTOL, name="dbeta")
    assert_close(dQK, rQK, rtol=RTOL, name="dQK")


@requires_kernels
def test_zero_chunks_forward_and_backward():
    A, beta, QK = (t.to(KERNEL_DEVICE).requires_grad_() for t in make_inputs(0, 16, seed=0))
    with on_kernels():
        X, QX = sdm_ops.wy_solve(A, beta, QK)
        assert X.shape == QX.shape == (0, 16, 16)
        dA, dbeta, dQK = torch.autograd.grad((X.sum() + QX.sum()), (A, beta, QK))
    assert dA.shape == dQK.shape == (0, 16, 16) and dbeta.shape == (0, 16)


@requires_cuda
def test_forward_and_backward_are_bitwise_deterministic_on_cuda():
    n, c = 4096, 64
    A, beta, QK = (t.cuda() for t in make_inputs(n, c, seed=11))
    dX, dQX = (t.cuda() for t in make_output_grads(n, c, seed=11))
    runs = []
    for _ in range(2):
        X, QX = sdm_ops.wy_solve(A, beta, QK)
        grads = torch.ops.sdm_internal.wy_solve_backward(A, beta, QK, X, dX, dQX)
        runs.append((X, QX, *grads))
    for name, first, second in zip(("X", "QX", "dA", "dbeta", "dQK"), *runs):
        assert torch.equal(first, second), f"{name} differs between two runs"


# How far the kernels that skip zero tiles may be from the dense ones, in units of the largest
# entry: compiled, the two may lay out and so round their reductions in another order.
DENSE_ROUNDING = 2.0**-20


def assert_same_as_dense(got, dense, name):
    """The skipping kernels' values are the dense kernels': bitwise in the interpreter (both
    evaluate the same sums in the same order), within DENSE_ROUNDING compiled."""
    diff = float((got - dense).abs().max())
    message = (
        f"{name} differs from the dense kernels in {int((got != dense).sum())} entries, "
        f"by up to {diff:.3g}"
    )
    if HAS_CUDA:
        assert diff <= DENSE_ROUNDING * float(dense.abs().max()), message
    else:
        assert torch.equal(got, dense), message


@requires_kernels
@pytest.mark.parametrize("c", (33, 64, 128))
def test_zero_tiles_skipped_give_the_dense_kernels_results(c, monkeypatch):
    """On sparse A and QK, the kernels that skip zero tiles match the float64 reference and give
    the values of the kernels that run every product, forward and backward."""
    n = 24 if HAS_CUDA else 6
    A, beta, QK = make_sparse_inputs(n, c, seed=300 + c)
    dX, dQX = make_output_grads(n, c, seed=300 + c)
    runs = {}
    for skip in (True, False):
        monkeypatch.setattr(wy_kernels, "SKIP_ZERO_TILES", skip)
        runs[skip] = (*kernel_solve(A, beta, QK), *kernel_grads(A, beta, QK, dX, dQX))
    want = (
        *wy_solve_reference(A.double(), beta.double(), QK.double()),
        *reference_grads(A, beta, QK, dX, dQX),
    )
    for name, got, dense, ref in zip(
        ("X", "QX", "dA", "dbeta", "dQK"), runs[True], runs[False], want
    ):
        assert_close(got, ref, rtol=RTOL, name=f"{name} (C={c})")
        assert_same_as_dense(got, dense, f"{name} (C={c})")


@requires_kernels
def test_a_tile_holding_only_a_nan_is_not_skipped(monkeypatch):
    """A NaN is not zero: a tile of A that is zero but for one NaN is multiplied, so the NaN
    reaches X and QX; it reaches no more entries than in the dense kernels (the zeros of zero
    tiles and identity blocks are structural), and the finite entries are the dense ones."""
    c = 48
    A, beta, QK = make_sparse_inputs(3, c, seed=5)
    A[2] = 0.0
    A[2, 40, 20] = math.nan  # in tile (2, 1)
    A[2, 20, 3] = 0.25  # makes X[1, 0] not zero
    runs = {}
    for skip in (True, False):
        monkeypatch.setattr(wy_kernels, "SKIP_ZERO_TILES", skip)
        runs[skip] = kernel_solve(A, beta, QK)
    X = runs[True][0]
    assert X[2, 40, 20].isnan() and X[2, 40, 3].isnan(), "the NaN was skipped"
    for got, dense, name in zip(runs[True], runs[False], ("X", "QX")):
        assert not (got.isnan() & ~dense.isnan()).any(), f"{name}: NaN where the dense has none"
        finite = ~dense.isnan()
        assert_same_as_dense(got[finite], dense[finite], f"{name}'s finite entries")


def _mixed_chunks(C: int, seed: int) -> dict:
    """Recurrence inputs (B = 1, H = 2) whose chunks take every path of the recurrence's solve:
    addressing over 3 C^2 slots (about four pairs of shared entries, and the chain below: one
    window, the pairs solve), over 24 slots (more shared entries than a window: the panel
    kernels), onto one slot (a bucket over the window: phase 1's dense kernels, then the panel
    kernels), and a partial last chunk over 5000 slots."""
    from tests.helpers import make_sdm_inputs

    a = make_sdm_inputs(B=1, T=3 * C + C // 2, H=2, D=16, S=5000, W=3, R=2, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name in ("write_idx", "read_idx"):
        idx = a[name]
        idx[:, :C] = torch.randint(0, 3 * C * C, idx[:, :C].shape, generator=g)
        idx[:, C : 2 * C] = torch.randint(0, 24, idx[:, C : 2 * C].shape, generator=g)
        idx[:, 2 * C : 3 * C] = 7
    # In the first chunk, tokens 1, 3, 6 and 8 write slot 4999 and token 5 reads it: X holds
    # a chain of three (X[8, 1] through X[6, 3] and X[3, 1]: two passes of the pairs solve
    # after its first), and QX[5, 1] takes QK[5, 3] X[3, 1].
    a["write_idx"][:, [1, 3, 6, 8], :, 0] = 4999
    a["read_idx"][:, 5, :, 0] = 4999
    return {k: v.to(KERNEL_DEVICE) for k, v in a.items()}


@requires_kernels
@pytest.mark.parametrize("c", [16, 32, 64])
def test_pairs_solve_matches_the_float64_solve_on_phase_1s_chunks(c, monkeypatch):
    """``sdm_internal::wy_solve_pairs`` on phase 1's A, QK and pair lists, with chunks of every
    path in one call: X and QX within float32 rounding of the float64 solve, +0.0 above the
    diagonal, ones on it; the chunks the pairs solve leaves to the panel kernels bitwise as
    the panel kernels alone give them, and the others close to those."""
    from sdm_ops import ops
    from sdm_ops.layout import Prepared
    from sdm_ops.ops.recurrence import _chunk_betas

    a = _mixed_chunks(c, seed=40 + c)
    S = 5000
    with on_kernels():
        outs = ops.chunk_prepare(
            a["write_idx"], a["write_w"], a["read_idx"], a["read_w"], a["decay"], S, c
        )
    n = len(Prepared._fields)
    A, QK = (t.reshape(-1, c, c) for t in outs[:2])
    count, entries = outs[n].reshape(-1), outs[n + 1].reshape(-1, outs[n + 1].shape[-1])
    beta = _chunk_betas(a["beta"], c)
    mc = min(32, entries.shape[-1])
    solved = ((count >= 0) & (count <= mc)).cpu()
    many = (count > mc).cpu()
    assert solved.any() and many.any() and (count == -1).any(), count
    with on_kernels():
        X, QX = (t.cpu() for t in ops.wy_solve_pairs(A, beta, QK, count, entries))
        monkeypatch.setattr(wy_kernels, "PAIRS_SOLVE", False)
        pX, pQX = (t.cpu() for t in ops.wy_solve_pairs(A, beta, QK, count, entries))
    rX, rQX = wy_solve_reference(A.cpu().double(), beta.cpu().double(), QK.cpu().double())
    assert_close(X, rX, rtol=RTOL, name=f"X (C={c})")
    assert_close(QX, rQX, rtol=RTOL, name=f"QX (C={c})")
    assert_exact_zero_above(X, 1, "X")
    assert_exact_zero_above(QX, 1, "QX")
    assert torch.equal(torch.diagonal(X, dim1=1, dim2=2), torch.ones(len(X), c))
    assert torch.equal(X[~solved], pX[~solved]) and torch.equal(QX[~solved], pQX[~solved])
    assert_close(X[solved], pX[solved], rtol=RTOL, name="X against the panels")
    assert_close(QX[solved], pQX[solved], rtol=RTOL, name="QX against the panels")
    # Some solved chunk holds more than the identity (a pair term of A reached X).
    assert (X[solved] != torch.eye(c)).any()
