"""The product-key top-k kernels and the factorized CPU path against the brute force, the tie
rule, the sparse backward and the argument checks of ``sdm_ops.product_key_topk``.

Kernel results come from ``with on_kernels():`` (natively on CUDA, under the Triton interpreter
on CPU); the CPU path's from ``sdm_ops.product_key_topk`` on CPU tensors (the factorized
``reference.product_key_topk_reference``). The oracle is
``reference.product_key_topk_bruteforce``, which scores every slot of the product space.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sdm_ops
from sdm_ops.kernels import product_key_topk as kern
from sdm_ops.reference import (
    product_key_topk_backward_reference,
    product_key_topk_bruteforce,
    product_key_topk_reference,
)
from tests.helpers import KERNEL_DEVICE, assert_close, on_kernels, requires_cuda, requires_kernels

DTYPES = (torch.float32, torch.bfloat16)

# Under the interpreter, inf - inf in a score is computed by numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def make_raw(shape, factors, dtype, kind="randn", seed=0) -> torch.Tensor:
    """raw [*shape, sum(factors)] on CPU: "randn", "ties" (integers 0..2, most scores tied) or
    "special" (ties plus NaN, +-inf and -0 sprinkled in)."""
    g = torch.Generator().manual_seed(seed)
    size = (*shape, sum(factors))
    if kind == "randn":
        raw = torch.randn(size, generator=g)
    else:
        raw = torch.randint(0, 3, size, generator=g).to(torch.float32)
        if kind == "special":
            pick = torch.randint(0, 8, size, generator=g)
            specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0])
            raw = torch.where(pick < 4, specials[pick.clamp(max=3)], raw)
    return raw.to(dtype)


def kernel_topk(raw, factors, k):
    with on_kernels():
        val, lin = sdm_ops.product_key_topk(raw.to(KERNEL_DEVICE), factors, k)
    return val.cpu(), lin.cpu()


def cpu_topk(raw, factors, k):
    val, lin = sdm_ops.product_key_topk(raw.cpu(), factors, k)
    return val, lin


def reference_topk(raw, factors, k):
    # Plain torch, no atomics: on the kernel device (large CUDA cases are too slow on CPU).
    val, lin = product_key_topk_bruteforce(raw.to(KERNEL_DEVICE), tuple(factors), k)
    return val.cpu(), lin.cpu()


def _empty_topk(raw, factors, k):
    # The reference cannot reshape zero rows of several factors; nothing to select anyway.
    kk = min(k, math.prod(factors))
    shape = (*raw.shape[:-1], kk)
    return torch.empty(shape, dtype=raw.dtype), torch.empty(shape, dtype=torch.int64)


def assert_same_topk(raw, factors, k, run=kernel_topk):
    """``run`` (the kernels, or the CPU path) and the brute force select the same slots with
    bitwise equal values (NaN == NaN, -0 != +0)."""
    val, lin = run(raw, factors, k)
    rval, rlin = (reference_topk if raw.numel() else _empty_topk)(raw, factors, k)
    kk = min(k, math.prod(factors))
    assert lin.shape == rlin.shape == (*raw.shape[:-1], kk)
    assert val.dtype == raw.dtype and lin.dtype == torch.int64
    if not torch.equal(lin, rlin):
        bad = (lin != rlin).nonzero()[0].tolist()
        raise AssertionError(
            f"factors {factors} k {k}: lin differs first at {bad}: "
            f"got {lin[tuple(bad[:-1])].tolist()} "
            f"brute force {rlin[tuple(bad[:-1])].tolist()}"
        )
    bits = torch.int16 if raw.dtype == torch.bfloat16 else torch.int32
    same = (val.view(bits) == rval.view(bits)) | (val.isnan() & rval.isnan())
    assert bool(same.all()), (
        f"factors {factors} k {k}: val differs at "
        f"{(~same).nonzero()[0].tolist()}: "
        f"{val[~same][:4]} vs {rval[~same][:4]}"
    )


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "factors", [(13,), (6, 5), (3, 7), (4, 3, 5), (5, 1, 4), (2, 3, 2, 2), (3, 2, 3, 2)], ids=str
)
def test_forward_matches_reference_for_one_to_four_factors(factors, dtype):
    for k in (1, 3, 8, math.prod(factors), 256):
        assert_same_topk(make_raw((5,), factors, dtype, seed=k), factors, k)


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "factors,k",
    [((7,), 4), ((6, 6), 5), ((6, 6), 36), ((4, 4, 3), 9), ((3, 3, 2, 3), 17), ((1, 1, 5, 1), 2)],
    ids=str,
)
def test_forward_tie_rule_on_heavy_ties(factors, k, dtype):
    """Scores from integers 0..2: nearly every selection boundary falls inside a tie."""
    assert_same_topk(make_raw((19,), factors, dtype, "ties", seed=k), factors, k)


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "factors,k", [((9,), 5), ((5, 6), 7), ((3, 4, 3), 12), ((2, 3, 2, 2), 24)], ids=str
)
def test_forward_nan_inf_and_negative_zero(factors, k, dtype):
    """NaN counts as -inf, -0 equals +0; NaN and -0 values come back exactly."""
    assert_same_topk(make_raw((23,), factors, dtype, "special", seed=k), factors, k)


PATHS = [
    pytest.param(kernel_topk, id="kernels", marks=requires_kernels),
    pytest.param(cpu_topk, id="cpu"),
]


@pytest.mark.parametrize("run", PATHS)
def test_forward_tie_rule_by_hand(run):
    """Equal scores go to the better prefix rank, then the better column rank, not the smaller
    slot; NaN ties with -inf and loses to the smaller column."""
    raw = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # factors (2, 2)
    val, lin = run(raw, (2, 2), 3)
    # Ranks: (c0=1, c1=0), (1, 1), (0, 0): slots 2, 3, 0.
    assert lin.tolist() == [[0, 2, 3]] and val.tolist() == [[0.0, 1.0, 1.0]]
    raw = torch.tensor([[5.0, 5.0, 2.0, 3.0, 3.0]])  # factors (2, 3)
    _, lin = run(raw, (2, 3), 3)
    # Score 8 for (0, 1), (0, 2), (1, 1), (1, 2): prefix rank 0 first, then column rank.
    assert lin.tolist() == [[1, 2, 4]]
    raw = torch.tensor([[math.nan, -math.inf, -1.0]])
    val, lin = run(raw, (3,), 2)
    assert lin.tolist() == [[0, 2]] and math.isnan(val[0, 0]) and val[0, 1] == -1.0
    raw = torch.tensor([[-0.0, 0.0]])
    val, lin = run(raw, (2,), 1)
    assert lin.tolist() == [[0]] and torch.signbit(val).item()


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_leading_dims(dtype):
    raw = make_raw((2, 3), (4, 5), dtype, seed=1)
    assert_same_topk(raw, (4, 5), 6)
    val, lin = kernel_topk(raw, (4, 5), 6)
    assert val.shape == lin.shape == (2, 3, 6)


@requires_kernels
@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)], ids=str)
def test_forward_zero_rows(shape):
    raw = torch.zeros(*shape, 7)
    val, lin = kernel_topk(raw, (3, 4), 5)
    assert val.shape == lin.shape == (*shape, 5)


@requires_kernels
def test_forward_rows_not_a_multiple_of_the_block():
    """Programs own several rows; the last program's rows past n are masked."""
    factors = (4, 4)
    block = kern._fwd_config(list(factors), 4, 4)["ROWS"]
    assert block > 1
    assert_same_topk(make_raw((3 * block + 1,), factors, torch.float32, seed=3), factors, 4)


@requires_kernels
@pytest.mark.parametrize(
    "dtype,factors", [(torch.float32, (256, 256)), (torch.bfloat16, (512, 3))], ids=str
)
def test_forward_factors_wider_than_a_warps_loads(dtype, factors):
    """A factor chunk wider than one warp's loads (512 bytes) runs on one warp with at most
    2048 bytes of rows a program; rows not a multiple of those, so the last program is partly
    masked, with random and tied scores, within and past the rounds' cut-off."""
    meta = kern._fwd_config(list(factors), 8, dtype.itemsize)
    narrow = kern._fwd_config(list(factors), 8, 1)  # itemsize 1: no row is that wide
    chunk = min(max(factors), kern._FWD_CHUNK)
    assert meta["num_warps"] == 1
    assert 1 < meta["ROWS"] < narrow["ROWS"] and meta["ROWS"] * chunk * dtype.itemsize <= 2048
    n = 2 * meta["ROWS"] + 1
    for k, kind in ((8, "randn"), (20, "ties")):
        assert_same_topk(make_raw((n,), factors, dtype, kind=kind, seed=k), factors, k)


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_wide_merge_stage_takes_fewer_rows_a_program(dtype):
    """A merge stage as wide as the factor chunks (k = 32 over (256, 256): 256 candidate
    pairs) leaves a thread at most 8 of its elements, so programs take fewer rows than at
    k = 8 (one a warp); rows not a multiple of those, random and tied scores."""
    factors = (256, 256)
    meta = kern._fwd_config(list(factors), 32, dtype.itemsize)
    small_k = kern._fwd_config(list(factors), 8, dtype.itemsize)
    assert meta["CS1"] == 256 and meta["ROWS"] * 256 <= 8 * 32 * meta["num_warps"]
    assert meta["ROWS"] < small_k["ROWS"] and meta["ROWS"] == meta["num_warps"]
    n = 2 * meta["ROWS"] + 1
    for kind in ("randn", "ties"):
        assert_same_topk(make_raw((n,), factors, dtype, kind=kind, seed=32), factors, 32)


@requires_kernels
@pytest.mark.parametrize(
    "factors,k",
    [((4096,), 16), ((600, 3), 40), ((64, 64), 256), ((16, 16, 16), 48), ((2, 4096), 3)],
    ids=str,
)
def test_forward_wide_factors_and_large_k(factors, k):
    """Factors wider than a chunk (merged chunk by chunk) and stages of several candidate
    chunks (k = 256)."""
    assert_same_topk(make_raw((1,), factors, torch.float32, seed=k), factors, k)


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [3, 16])
def test_forward_chunked_factor_merges_short_lists(dtype, k):
    """A factor of three chunks whose short top lists (taken by rounds of a maximum) are
    merged chunk by chunk, with ties across chunks: int64 keys (float32 rows) and int32
    (bfloat16), past and within the rounds' cut-offs."""
    factors = (1100, 2)
    for kind in ("randn", "ties"):
        assert_same_topk(make_raw((3,), factors, dtype, kind=kind, seed=k), factors, k)


@requires_cuda
@pytest.mark.slow
@pytest.mark.parametrize(
    "factors,k",
    [
        ((4096,), 256),
        ((4096, 4096), 256),
        ((4096, 3), 256),
        ((16, 16, 16, 16), 256),
        ((4096, 2, 4096, 1), 100),
        ((1, 1, 1, 1), 1),
    ],
    ids=str,
)
def test_cuda_widest_factors_and_largest_k(factors, k):
    for kind in ("randn", "special"):
        assert_same_topk(make_raw((3,), factors, torch.float32, kind, seed=k), factors, k)


# ---------------------------------------------------------------------------
# The CPU path: factor by factor, equal to the brute force
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
@pytest.mark.parametrize(
    "factors",
    [
        (13,),
        (1,),
        (6, 5),
        (1, 7),
        (7, 1),
        (4, 3, 5),
        (5, 1, 4),
        (1, 1, 1),
        (2, 3, 2, 2),
        (3, 1, 3, 2),
        (1, 1, 1, 1),
        (9, 2, 1, 3),
    ],
    ids=str,
)
def test_cpu_path_equals_bruteforce(factors, kind, dtype):
    """Random scores, scores from integers 0..2 (the selection boundary inside ties) and
    scores with NaN, +-inf and -0; k below, between and above the factors' widths, and
    k >= prod(factors)."""
    top = math.prod(factors)
    for k in sorted({1, 2, 4, 7, 12, max(1, top - 1), top, top + 3, 256}):
        assert_same_topk(make_raw((11,), factors, dtype, kind, seed=k), factors, k, run=cpu_topk)


@pytest.mark.parametrize(
    "factors,k",
    [
        ((4096, 16), 256),
        ((16, 4096), 100),
        ((64, 64, 16), 256),
        ((2, 4096, 2, 4), 77),
        ((256, 256), 256),
    ],
    ids=str,
)
def test_cpu_path_wide_factors_and_large_k(factors, k):
    for kind in ("randn", "ties", "special"):
        assert_same_topk(
            make_raw((2,), factors, torch.float32, kind, seed=k), factors, k, run=cpu_topk
        )


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3), (2, 3)], ids=str)
def test_cpu_path_leading_dims_and_zero_rows(shape):
    raw = make_raw(shape, (4, 5), torch.float32, "ties", seed=2)
    val, lin = product_key_topk_reference(raw, (4, 5), 6)
    assert val.shape == lin.shape == (*shape, 6)
    if raw.numel():
        assert_same_topk(raw, (4, 5), 6, run=cpu_topk)


@pytest.mark.parametrize(
    "dtype,kind",
    [(torch.float32, "randn"), (torch.float32, "ties"), (torch.bfloat16, "randn")],
    ids=str,
)
def test_cpu_path_runs_the_readme_quick_start_shape(dtype, kind):
    """The README's call, raw [2, 256, 4, 512] over (256, 256) with k = 8, on CPU: a few rows
    against the brute force computed on those rows alone (65536 sums a row)."""
    raw = make_raw((2, 256, 4), (256, 256), dtype, kind, seed=8)
    val, lin = sdm_ops.product_key_topk(raw, (256, 256), k=8)
    assert val.shape == lin.shape == (2, 256, 4, 8)
    assert val.dtype == dtype and lin.dtype == torch.int64
    assert bool((lin[..., 1:] > lin[..., :-1]).all())
    rows = [(0, 0, 0), (0, 17, 2), (1, 100, 1), (1, 255, 3)]
    picked = torch.stack([raw[r] for r in rows])
    rval, rlin = product_key_topk_bruteforce(picked, (256, 256), 8)
    assert torch.equal(torch.stack([lin[r] for r in rows]), rlin)
    assert torch.equal(torch.stack([val[r] for r in rows]), rval)


def test_cpu_path_product_space_far_beyond_memory():
    """(4096,) * 4: 2**48 slots, which no brute force can score. Random distinct scores: the
    best slot takes each factor's largest column, and every value is its slot's float32 sum in
    factor order."""
    factors, k = (4096, 4096, 4096, 4096), 256
    raw = make_raw((3,), factors, torch.float32, seed=5)
    val, lin = sdm_ops.product_key_topk(raw, factors, k)
    assert val.shape == lin.shape == (3, k)
    assert bool((lin[:, 1:] > lin[:, :-1]).all()) and bool((lin >= 0).all())
    assert torch.equal(val, recomputed_scores(raw, lin, factors))
    best = torch.zeros(3, dtype=torch.int64)
    for block in raw.split(list(factors), dim=-1):
        best = best * block.shape[-1] + block.argmax(-1)
    assert bool((lin == best[:, None]).any(-1).all())
    assert torch.equal(val.max(-1).values, recomputed_scores(raw, best[:, None], factors)[:, 0])


def given_topk_cases(*, max_factor: int, max_factors: int, max_k: int):
    """Hypothesis' ``@given`` of the property tests: up to 4 rows of scores of 1 to
    ``max_factors`` factors of 1 to ``max_factor`` columns, k from 1 to ``max_k``, every dtype
    and kind of scores (random, tied, special values) and any seed."""
    return given(
        factors=st.lists(st.integers(1, max_factor), min_size=1, max_size=max_factors),
        k=st.integers(1, max_k),
        rows=st.integers(0, 4),
        dtype=st.sampled_from(DTYPES),
        kind=st.sampled_from(["randn", "ties", "special"]),
        seed=st.integers(0, 2**31 - 1),
    )


@settings(max_examples=60, deadline=None)
@given_topk_cases(max_factor=9, max_factors=4, max_k=256)
def test_property_cpu_path_equals_bruteforce(factors, k, rows, dtype, kind, seed):
    assert_same_topk(make_raw((rows,), factors, dtype, kind, seed), factors, k, run=cpu_topk)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


def kernel_grad(raw, factors, k, grad_val):
    with on_kernels():
        x = raw.to(KERNEL_DEVICE).requires_grad_(True)
        val, lin = sdm_ops.product_key_topk(x, factors, k)
        (grad,) = torch.autograd.grad(val, x, grad_val.to(KERNEL_DEVICE))
    return grad.cpu(), lin.cpu()


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "factors,k",
    [((11,), 4), ((3, 7), 21), ((6, 6), 9), ((5, 1, 4), 7), ((2, 3, 2, 2), 24), ((300, 2), 40)],
    ids=str,
)
def test_backward_matches_reference(factors, k, dtype):
    """Same float32 sums in the same (slot) order as the reference, rounded once."""
    raw = make_raw((2, 5), factors, dtype, "ties", seed=k)
    kk = min(k, math.prod(factors))
    grad_val = torch.randn(2, 5, kk, generator=torch.Generator().manual_seed(k)).to(dtype)
    grad, lin = kernel_grad(raw, factors, k, grad_val)
    expected = product_key_topk_backward_reference(lin, grad_val, tuple(factors))
    assert grad.dtype == dtype and grad.shape == raw.shape
    if dtype == torch.float32:
        assert torch.equal(grad, expected), f"max diff {(grad - expected).abs().max()}"
    else:
        assert torch.equal(grad, expected.to(dtype)), (
            f"max diff {(grad.float() - expected.to(dtype).float()).abs().max()}"
        )
    assert_close(grad, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, name="grad")


@requires_kernels
def test_backward_writes_every_element():
    """Columns no slot selects are written as zeros (the output starts as NaN here)."""
    factors = [5, 300, 2]
    lin = torch.tensor([[0, 7, 601, 2999], [5, 6, 7, 8], [2999, 2998, 1, 0]], dtype=torch.int64)
    lin = lin.sort(-1).values.to(KERNEL_DEVICE)
    grad_val = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(KERNEL_DEVICE) + 1
    grad = torch.full((3, sum(factors)), math.nan, device=KERNEL_DEVICE)
    with on_kernels():
        kern.product_key_topk_bwd(lin, grad_val, factors, grad)
    expected = product_key_topk_backward_reference(lin.cpu(), grad_val.cpu(), tuple(factors))
    assert torch.equal(grad.cpu(), expected)


GUARD = 37


def guarded_grad(n, width, dtype):
    """A NaN buffer and grad [n, width], a view of it with GUARD NaN elements either side."""
    buf = torch.full((n * width + 2 * GUARD,), math.nan, dtype=dtype, device=KERNEL_DEVICE)
    return buf, buf[GUARD : GUARD + n * width].view(n, width)


def assert_guards_intact(buf):
    assert buf[:GUARD].isnan().all() and buf[-GUARD:].isnan().all(), "wrote outside grad"


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "factors,kk",
    [
        ((256, 256), 8),
        ((256, 256), 32),
        ((300, 2), 40),
        ((1024, 4), 16),
        ((6, 6), 9),
        ((4096, 3), 5),
    ],
    ids=str,
)
def test_backward_over_several_programs(factors, kk, dtype):
    """2 ROWS + 3 rows: at least two whole programs and, where ROWS > 1, a partial last one,
    in the form each factor takes (scatter where it is wider than kk's power of two, dense
    otherwise): the reference's sums, every element written, nothing written outside grad.
    The slots come from a small pool, so most of a row's slots share a column of some factor.
    (4096, 3) takes one row a program, whose zeroing of 4099 elements ends in a partial
    block."""
    config = kern._bwd_config(list(factors), kk)
    n = 2 * config["ROWS"] + 3
    g = torch.Generator().manual_seed(kk)
    pool = torch.randint(0, math.prod(factors), (kk + 3,), generator=g)
    lin = pool[torch.rand(n, kk + 3, generator=g).argsort(-1)[:, :kk]]
    grad_val = torch.randn(n, kk, generator=g).to(dtype)
    buf, grad = guarded_grad(n, sum(factors), dtype)
    with on_kernels():
        kern.product_key_topk_bwd(lin.to(KERNEL_DEVICE), grad_val.to(KERNEL_DEVICE), factors, grad)
    expected = product_key_topk_backward_reference(lin, grad_val, tuple(factors)).to(dtype)
    assert torch.equal(grad.cpu(), expected), (
        f"max diff {(grad.cpu().float() - expected.float()).abs().max()}"
    )
    assert_guards_intact(buf)


@requires_kernels
@pytest.mark.parametrize("factors,kk", [((256, 256), 8), ((300, 2), 40), ((6, 6), 9)], ids=str)
def test_backward_any_slots_stay_inside_grad(factors, kk):
    """Slots no forward returns (negative, or past prod(factors)): each factor's column is
    the kernel's C-style (lin / S_f) % F_f, a negative one selecting nothing, in the scatter
    and the dense forms alike; nothing is written outside grad."""
    n, width = 2 * kern._bwd_config(list(factors), kk)["ROWS"] + 1, sum(factors)
    g = torch.Generator().manual_seed(3)
    top = math.prod(factors)
    lin = torch.randint(-2 * top, 2 * top, (n, kk), generator=g)
    grad_val = torch.randn(n, kk, generator=g)
    buf, grad = guarded_grad(n, width, torch.float32)
    with on_kernels():
        kern.product_key_topk_bwd(lin.to(KERNEL_DEVICE), grad_val.to(KERNEL_DEVICE), factors, grad)
    expected = torch.zeros(n, width)
    offset = 0
    for f, width_f in enumerate(factors):
        col = torch.fmod(
            torch.div(lin, math.prod(factors[f + 1 :]), rounding_mode="trunc"), width_f
        )
        keep = col >= 0
        expected[:, offset : offset + width_f].scatter_add_(
            1, torch.where(keep, col, 0), torch.where(keep, grad_val, 0.0)
        )
        offset += width_f
    assert torch.equal(grad.cpu(), expected), f"max diff {(grad.cpu() - expected).abs().max()}"
    assert_guards_intact(buf)


@requires_cuda
def test_backward_deterministic_on_cuda():
    factors, k = (256, 256), 256
    raw = make_raw((4096,), factors, torch.bfloat16, "ties").cuda()
    grad_val = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    first, _ = kernel_grad(raw, factors, k, grad_val)
    second, _ = kernel_grad(raw, factors, k, grad_val)
    assert torch.equal(first, second)


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factors,k,dtype,width,error,name",
    [
        ((), 4, torch.float32, 0, ValueError, "factors"),
        ((2, 2, 2, 2, 2), 4, torch.float32, 10, ValueError, "factors"),
        ((0, 3), 4, torch.float32, 3, ValueError, "factors"),
        ((4097,), 4, torch.float32, 4097, ValueError, "factors"),
        (5, 4, torch.float32, 5, TypeError, "factors"),
        ((2.0, 3), 4, torch.float32, 5, TypeError, "factors"),
        ((2, 3), 0, torch.float32, 5, ValueError, "k"),
        ((2, 3), 257, torch.float32, 5, ValueError, "k"),
        ((2, 3), 4.0, torch.float32, 5, TypeError, "k"),
        ((2, 3), 4, torch.float16, 5, TypeError, "raw"),
        ((2, 3), 4, torch.float64, 5, TypeError, "raw"),
        ((2, 3), 4, torch.float32, 6, ValueError, "raw"),
    ],
    ids=lambda v: str(v) if not isinstance(v, type) else v.__name__,
)
def test_bad_arguments_raise_naming_the_argument(factors, k, dtype, width, error, name):
    raw = torch.zeros(3, width, dtype=dtype)
    with pytest.raises(error, match=rf"\b{name}\b"):
        sdm_ops.product_key_topk(raw, factors, k)


def test_bad_raw_scalar_raises():
    with pytest.raises(ValueError, match="raw"):
        sdm_ops.product_key_topk(torch.tensor(1.0), (1,), 1)


# ---------------------------------------------------------------------------
# Property
# ---------------------------------------------------------------------------


@requires_kernels
@settings(max_examples=25, deadline=None)
@given_topk_cases(max_factor=12, max_factors=3, max_k=48)
def test_property_kernel_equals_reference(factors, k, rows, dtype, kind, seed):
    assert_same_topk(make_raw((rows,), factors, dtype, kind, seed), factors, k)


# ---------------------------------------------------------------------------
# Large shapes (CUDA)
# ---------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [8, 32, 256])
def test_cuda_large_matches_reference(k, dtype):
    factors = (256, 256)
    raw = make_raw((4096,), factors, dtype, seed=k)
    val, lin = kernel_topk(raw, factors, k)
    for r0 in range(0, raw.shape[0], 512):  # the reference materializes 65536 sums a row
        rval, rlin = reference_topk(raw[r0 : r0 + 512], factors, k)
        assert torch.equal(lin[r0 : r0 + 512], rlin), f"rows {r0}.."
        assert torch.equal(val[r0 : r0 + 512], rval), f"rows {r0}.."
    ties = make_raw((4096,), factors, dtype, "special", seed=k)
    for r0 in range(0, 4096, 1024):
        assert_same_topk(ties[r0 : r0 + 1024], factors, k)


def recomputed_scores(raw, lin, factors):
    """The float32 sum, in factor order, of the columns that ``lin`` names."""
    cols = []
    rest = lin
    for f in reversed(factors):
        cols.append(rest % f)
        rest = rest // f
    cols.reverse()
    x = raw.float()
    total, off = None, 0
    for f, c in zip(factors, cols):
        part = torch.gather(x, -1, c + off)
        total = part if total is None else total + part
        off += f
    return total


@requires_cuda
def test_cuda_million_rows_sorted_and_scores_recomputed():
    factors, k = (256, 256), 32
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randn(1 << 20, sum(factors), device="cuda", dtype=torch.bfloat16, generator=g)
    with on_kernels():
        val, lin = sdm_ops.product_key_topk(raw, factors, k)
    assert bool((lin[:, 1:] > lin[:, :-1]).all())
    assert bool(((lin >= 0) & (lin < 65536)).all())
    scores = recomputed_scores(raw, lin, factors)
    assert torch.equal(val, scores.to(raw.dtype))
    # Exact top-k: fewer than k slots of a row score strictly above its k-th best (rows 0..7).
    rows = raw[:8].float()
    sums = (rows[:, :256, None] + rows[:, None, 256:]).reshape(8, -1)
    kth = scores[:8].min(-1).values
    assert bool(((sums > kth[:, None]).sum(-1) < k).all())
