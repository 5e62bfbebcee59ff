"""Phase 1 (``sdm_internal::chunk_prepare`` and its backward) on both of its kernel paths against
the float64 reference: the sparse path (entries sorted by slot hash, only those that share a
bucket paired, a window of buckets at a time) and the dense path it hands heavy chunks to (a
bucket of more entries than a window holds). ``COMPACT`` sets the window: 0 turns the sparse
path off (the dense kernel does every chunk), 16 splits chunks between the two and takes
most in several windows, 32 is the default."""

import pytest
import torch

from sdm_ops import ops
from sdm_ops import reference as ref
from sdm_ops.kernels import _common
from sdm_ops.kernels import chunk_prepare as kernel
from sdm_ops.kernels import chunk_prepare_pairs as pairs
from sdm_ops.kernels import chunk_prepare_sparse as sparse
from tests.helpers import (
    KERNEL_DEVICE,
    assert_close,
    make_packed_sdm_inputs,
    make_sdm_inputs,
    on_kernels,
    requires_kernels,
    to_float64,
)

pytestmark = requires_kernels


@pytest.fixture
def heavy_flags(monkeypatch):
    """The per-chunk heavy flags (a bucket of more entries than COMPACT: count -1) of every
    sparse launch, and a setter of COMPACT."""
    seen = []
    launch = kernel.sparse_launch

    def spy(*args, **kwargs):
        shared = launch(*args, **kwargs)
        seen.append(None if shared is None else (shared < 0).cpu())
        return shared

    monkeypatch.setattr(kernel, "sparse_launch", spy)
    return seen, lambda mc: monkeypatch.setattr(sparse, "COMPACT", mc)


def _prepare(a, C, cu=None):
    S = a["bank"].shape[-2]
    tables = (None, None) if cu is None else ref.varlen_chunks(cu, a["v"].shape[1], C)
    with on_kernels(), torch.no_grad():
        prep = ops.chunk_prepare(
            a["write_idx"], a["write_w"], a["read_idx"], a["read_w"], a.get("decay"), S, C, *tables
        )
    return prep, tables


def _prepare_backward(a, grads, pairs, tables):
    """Phase 1's backward on the kernels; ``pairs``: the forward's ``layout.PairLists`` (the
    last two outputs of ``chunk_prepare``)."""
    S = a["bank"].shape[-2]
    with on_kernels(), torch.no_grad():
        return ops.chunk_prepare_backward(
            a["write_idx"],
            a["write_w"],
            a["read_idx"],
            a["read_w"],
            a.get("decay"),
            S,
            *grads,
            *pairs,
            *tables,
        )


def _reference(a, C, grads, cu=None):
    """Float64 phase 1 and its backward: (Prepared, (d_write_w, d_read_w, d_decay))."""
    x = to_float64(a)
    S = x["bank"].shape[-2]
    args = (x["write_idx"], x["write_w"], x["read_idx"], x["read_w"], x.get("decay"), S)
    g = [t.cpu().double() for t in grads]
    if cu is None:
        return (
            ref.chunk_prepare_reference(*args, C),
            ref.chunk_prepare_backward_reference(*args, *g),
        )
    tables = ref.varlen_chunks(cu.cpu(), x["v"].shape[1], C)
    return (
        ref.chunk_prepare_varlen_reference(*args, C, *tables),
        ref.chunk_prepare_backward_varlen_reference(*args, *g, *tables),
    )


def _check(a, C, cu=None, seed=0):
    prep, tables = _prepare(a, C, cu)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(t.shape, generator=gen).to(t.device) for t in prep[:6]]
    expected, expected_grads = _reference(a, C, grads, cu)
    for name, got, want in zip(ref.Prepared._fields, prep, expected):
        if got.is_floating_point():
            assert_close(got, want, rtol=1e-5, name=name)
        else:
            assert torch.equal(got.cpu().long(), want.long()), name
    got_grads = _prepare_backward(a, grads, prep[8:], tables)
    for name, got, want in zip(("d_write_w", "d_read_w", "d_decay"), got_grads, expected_grads):
        if want is not None:
            assert_close(got, want, rtol=1e-5, name=name)


@pytest.mark.parametrize("compact", [0, 16, 32])
@pytest.mark.parametrize(
    "case",
    [
        dict(T=37, W=3, R=2, S=11),  # every slot shared: mostly heavy chunks
        dict(T=40, W=8, R=8, S=300),  # some shared slots per chunk
        dict(T=21, W=4, R=3, S=60, decay=False),
        dict(T=33, W=2, R=5, S=40, zero_decay=0.5),  # many decays of exactly 0
    ],
)
def test_phase1_and_backward_match_float64_on_both_paths(heavy_flags, compact, case):
    seen, set_compact = heavy_flags
    set_compact(compact)
    a = make_sdm_inputs(B=2, H=2, D=16, seed=compact + case["T"], device=KERNEL_DEVICE, **case)
    _check(a, 16, seed=compact)
    assert len(seen) == 2  # forward and backward
    if compact == 0:
        assert seen == [None, None], "COMPACT=0 must turn the sparse path off"
    else:
        prep, _ = _prepare(a, 16)
        _check_pair_lists(a, 16, compact, *prep[8:])


def _check_pair_lists(a, C, MC, count, entries):
    """The forward's ``layout.PairLists`` against a sort of every chunk in torch: each chunk's
    entries are a permutation of its positions, the first ``count`` of them exactly those that
    share a hash bucket with another valid entry, in (bucket, position) order; count is -1
    where a bucket holds more than MC entries."""
    B, T, H, W = a["write_idx"].shape
    R = a["read_idx"].shape[-1]
    S = a["bank"].shape[-2]
    NP = entries.shape[-1]
    EM = NP // (2 * C)
    KB = NP.bit_length() - 1
    none = (1 << (30 - KB)) - 1
    pos = torch.arange(NP)
    tok, side, j = pos // (2 * EM), (pos // EM) % 2, pos % EM
    count, entries = count.cpu(), entries.cpu()
    for p in range(B * H):
        b, h = divmod(p, H)
        for n in range(-(-T // C)):
            t = n * C + tok
            exists = (t < T) & (j < torch.where(side == 1, R, W))
            tc = t.clamp(max=T - 1)
            raw = torch.where(
                side == 1,
                a["read_idx"][b, tc, h, j.clamp(max=R - 1)].cpu().long(),
                a["write_idx"][b, tc, h, j.clamp(max=W - 1)].cpu().long(),
            )
            valid = exists & (raw >= 0) & (raw < S)
            bucket = ((raw * 0x9E3779B1) >> 20) & none
            bucket = torch.where(bucket == none, 0, bucket)
            bucket = torch.where(valid, bucket, none)
            sizes = torch.bincount(bucket, minlength=none + 1)[bucket]
            shared = valid & (sizes > 1)
            heavy = bool((valid & (sizes > MC)).any())
            order = torch.argsort(bucket * NP + pos)
            want = order[shared[order]]
            row = entries[p, n]
            assert torch.equal(row.sort().values, pos.int()), (p, n)
            assert count[p, n] == (-1 if heavy else len(want)), (p, n)
            assert torch.equal(row[: len(want)].long(), want), (p, n)


@pytest.mark.parametrize("marked", [0.0, 0.5, 1.0])
def test_backward_is_right_with_any_chunks_marked_for_the_dense_kernels(marked):
    """The backward takes the forward's pair lists as given: a chunk marked -1 goes to the
    dense kernels whatever the forward found (the CPU twin marks every chunk so), the others
    to the lone-entry kernel and the pairs' backward, which overwrites the lone gradients of
    the compact list's entries."""
    a = make_sdm_inputs(B=2, H=2, D=16, T=61, W=4, R=4, S=150, seed=9, device=KERNEL_DEVICE)
    C = 16
    prep, tables = _prepare(a, C)
    count, entries = prep[8:]
    pick = torch.rand(count.shape, generator=torch.Generator().manual_seed(9)) < marked
    count = torch.where(pick.to(count.device), -1, count)
    gen = torch.Generator().manual_seed(10)
    grads = [torch.randn(t.shape, generator=gen).to(t.device) for t in prep[:6]]
    _, expected = _reference(a, C, grads)
    got = _prepare_backward(a, grads, (count, entries), tables)
    assert expected[2] is not None  # with decay
    for name, x, want in zip(("d_write_w", "d_read_w", "d_decay"), got, expected):
        assert_close(x, want, rtol=1e-5, name=name)


def test_the_paths_split_chunks_and_both_run(heavy_flags, monkeypatch):
    """With a window of 16, some chunks of the same call are light and some heavy: in every
    other chunk of stream 0 and in chunk 1 of stream 3, a slot that 9 tokens write twice (18
    entries in a bucket). The dense kernels' grid is bounded to 2 chunk programs, so that one
    of them takes the heavy chunks 0 and 2 (the second on its second step), the other the
    last stream's."""
    seen, set_compact = heavy_flags
    set_compact(16)
    monkeypatch.setattr(_common, "STRIDED_PROGRAMS", 2)
    a = make_sdm_inputs(B=2, H=2, D=16, T=64, W=8, R=8, S=2000, seed=3, device=KERNEL_DEVICE)
    for b, h, n in ((0, 0, 0), (0, 0, 2), (1, 1, 1)):
        a["write_idx"][b, 16 * n : 16 * n + 9, h, :2] = 1999
    _check(a, 16, seed=3)
    flags = seen[0]
    assert flags.view(-1).tolist() == [True, False, True, False] + [False] * 8 + [
        False,
        True,
        False,
        False,
    ], f"heavy flags {flags.tolist()}"


def test_windows_take_many_shared_entries_in_small_buckets(heavy_flags, monkeypatch):
    """A small bank: most of a chunk's 128 entries share a slot, in buckets of a few entries,
    so the sparse path takes every chunk in several windows of 16 (and the forward sums A and
    QK over them), with no chunk left to the dense path. The windowed tier's grid is bounded
    to 2 programs that load the counts of 2 chunks of their walk at a time: program 0 takes
    chunks 0 and 2 from its first two loads and chunk 4 from its next two (whose other chunk,
    6, is past the last), program 1 chunks 1, 3 and 5."""
    seen, set_compact = heavy_flags
    set_compact(16)
    monkeypatch.setattr(_common, "STRIDED_PROGRAMS", 2)
    monkeypatch.setattr(pairs, "_WALK", 2)
    windows = []
    launch = pairs.wrap_triton

    def spy(fn):
        launcher = launch(fn)
        if fn is not pairs._chunk_pairs_kernel:
            return launcher

        class Spy:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    windows.append((kw["MC"], kw["HI"], grid))
                    return launcher[grid](*args, **kw)

                return run

        return Spy()

    monkeypatch.setattr(pairs, "wrap_triton", spy)
    a = make_sdm_inputs(B=1, H=2, D=16, T=48, W=4, R=4, S=100, seed=8, device=KERNEL_DEVICE)
    _check(a, 16, seed=8)
    shared = _shared_counts(a, 16)
    assert (shared > 16).all(), f"shared entries per chunk {shared.tolist()}"
    assert not seen[0].any() and not seen[1].any()
    # (window, largest count, grid) per tier
    assert windows == [(16, 16, (3, 2)), (16, 128, (2, 1))], windows


def _shared_counts(a, C):
    """Entries per chunk that share a slot with another entry of the chunk (bench's count)."""
    from benchmarks import bench

    return bench.shared_entries({k: a[k].cpu() for k in ("write_idx", "read_idx")}, C)[0].flatten()


def test_a_large_bank_takes_the_sparse_path_for_every_chunk(heavy_flags):
    seen, _ = heavy_flags
    a = make_sdm_inputs(B=1, H=2, D=16, T=70, W=8, R=8, S=100000, seed=4, device=KERNEL_DEVICE)
    # Some slots shared inside chunks: every 8th token reads two slots the token before it
    # wrote, and every 4th token writes one of its slots twice.
    a["read_idx"][:, 1::8, :, :2] = a["write_idx"][:, :-1:8, :, :2]
    a["write_idx"][:, ::4, :, 7] = a["write_idx"][:, ::4, :, 6]
    _check(a, 32, seed=4)
    assert not seen[0].any()
    # Chunks of every pairs path: the one-window tier's two window sizes (at most 16 shared
    # entries, at most 32) and the windowed tier.
    m = _shared_counts(a, 32)
    assert ((m > 0) & (m <= 16)).any() and ((m > 16) & (m <= 32)).any() and (m > 32).any(), (
        m.tolist()
    )


@pytest.mark.parametrize("compact", [0, 32])
def test_packed_batch_on_both_paths(heavy_flags, compact):
    _, set_compact = heavy_flags
    set_compact(compact)
    a = make_packed_sdm_inputs([5, 19, 0, 30], S=200, W=4, R=4, seed=5, device=KERNEL_DEVICE)
    _check(a, 16, cu=a["cu_seqlens"], seed=5)


def test_geometries_past_the_sparse_limit_use_the_dense_path_alone(heavy_flags):
    seen, _ = heavy_flags
    a = make_sdm_inputs(B=1, H=1, D=16, T=20, W=40, R=3, S=5000, seed=6, device=KERNEL_DEVICE)
    assert sparse.sparse_geometry(40, 3, 32) is None
    _check(a, 32, seed=6)
    assert seen == [None, None]


@pytest.mark.parametrize("compact", [0, 32])
def test_out_of_range_indices_act_as_padding_on_both_paths(heavy_flags, compact):
    """Compiled code skips the eager index check: phase 1 and its backward treat an index
    outside [0, S) exactly as -1 (lone or not, on either path)."""
    _, set_compact = heavy_flags
    set_compact(compact)
    S = 3000
    a = make_sdm_inputs(B=1, H=2, D=16, T=40, W=4, R=4, S=S, seed=7, device=KERNEL_DEVICE)
    clean = {k: v.clone() for k, v in a.items()}
    for name, t, j, bad in (
        ("write_idx", 3, 1, S),
        ("write_idx", 17, 0, -7),
        ("read_idx", 5, 2, 10**6),
        ("read_idx", 30, 3, S + 1),
    ):
        a[name][0, t, 1, j] = bad
        clean[name][0, t, 1, j] = -1
    prep, tables = _prepare(a, 16)
    prep_c, _ = _prepare(clean, 16)
    for name, x, y in zip(ref.Prepared._fields, prep, prep_c):
        assert torch.equal(x, y), name
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(t.shape, generator=gen).to(t.device) for t in prep[:6]]
    got = _prepare_backward(a, grads, prep[8:], tables)
    for x, y in zip(got, _prepare_backward(clean, grads, prep_c[8:], tables)):
        assert torch.equal(x, y)
