"""The recurrence's internal operators (namespace ``sdm_internal``), which the public
``sdm::sparse_delta_memory`` and ``sdm::sparse_delta_memory_`` (``ops/recurrence.py``) run:
the chunk tables of a packed batch (``varlen_chunks``), the finite inputs of phase 1
(``finite_select``), phase 1 (``chunk_prepare``), the bank copy (``bank_copy``), phase 2
(``recurrence_fwd``; ``recurrence_fwd_`` in place), one decode step (``decode_step_``), and the
backwards (``recurrence_bwd``, ``rows_to_bank``, ``chunk_prepare_backward``).

Each is declared once by its body's signature (``_define.kernel_op``): the kernel path and the
CPU path take its arguments as one NamedTuple ``a``. The body of operator ``x`` is ``_x``,
which the public operators' bodies and backwards call without a dispatch
(``eager.in_backward``). They take contiguous inputs; ``chunks`` and ``seq_chunks``
(``reference.varlen_chunks``) describe a packed batch, None otherwise. The kernels and their
math are in ``sdm_ops/kernels``, the fakes in ``sdm_ops/meta/recurrence.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _finite, layout, reference, working_set
from ..kernels._common import on_device
from ..layout import SKIP_SNAPSHOT
from ..meta import recurrence as meta
from ._define import kernel_op


def _prepared(a) -> layout.Prepared:
    """Phase 1's per-entry outputs among the arguments ``a`` (A and QK are not passed on; nor
    is read_rank where ``a`` has none)."""
    return layout.Prepared(
        None,
        None,
        a.gather_w,
        a.gather_r,
        a.scatter_w,
        a.row_decay,
        a.rank,
        getattr(a, "read_rank", None),
    )


# ---------------------------------------------------------------------------
# sdm_internal::varlen_chunks: a packed batch's chunk tables
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::varlen_chunks", on="cu_seqlens", fake=meta.varlen_chunks_fake)
def _varlen_chunks(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The chunk tables of a packed batch, (chunks [NC, 2], seq_chunks [N + 1]) int64, which
    every operator of the recurrence takes; see ``reference.varlen_chunks`` (any offsets give
    tables inside the batch, so compiled code needs no check of ``cu_seqlens``)."""


@_varlen_chunks.kernels
def _varlen_chunks_kernels(a) -> tuple[Tensor, Tensor]:
    from ..kernels import varlen as k

    chunks, seq_chunks = meta.varlen_chunks_fake(a)
    with on_device(a.cu_seqlens):
        k.varlen_chunks(*a, chunks, seq_chunks)
    return chunks, seq_chunks


@_varlen_chunks.reference
def _varlen_chunks_cpu(a) -> tuple[Tensor, Tensor]:
    chunks, seq_chunks = reference.varlen_chunks(*a)
    return chunks.contiguous(), seq_chunks.contiguous()


varlen_chunks = _varlen_chunks.op


# ---------------------------------------------------------------------------
# sdm_internal::finite_select: phase 1's finite inputs
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::finite_select", on="write_idx", fake=meta.finite_select_fake)
def _finite_select(
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    bank_rows: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The finite inputs of phase 1 and the WY solve and the masks of what they keep, in the
    order of ``_finite.SELECTED`` (without decay, decay and its mask are empty); see
    ``sdm_ops/_finite.py`` for the rules and ``kernels/finite_select.py``."""


@_finite_select.kernels
def _finite_select_kernels(a) -> tuple[Tensor, ...]:
    from ..kernels import finite_select as k

    outs = meta.finite_select_fake(a)
    with on_device(a.write_idx):
        k.finite_select(*a, outs)
    return outs


@_finite_select.reference
def _finite_select_cpu(a) -> tuple[Tensor, ...]:
    return _finite.select(*a)


finite_select = _finite_select.op


# ---------------------------------------------------------------------------
# sdm_internal::chunk_prepare: phase 1
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::chunk_prepare", on="write_idx", fake=meta.chunk_prepare_fake)
def _chunk_prepare(
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    bank_rows: int,
    chunk_size: int,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 1: the fields of ``layout.Prepared`` (A, QK, gather_w, gather_r, scatter_w,
    row_decay, rank, read_rank), then of ``layout.PairLists`` (what the sparse path sorted, for
    ``chunk_prepare_backward``); see ``kernels/chunk_prepare.py`` for the math and layouts."""


@_chunk_prepare.kernels
def _chunk_prepare_kernels(a) -> tuple[Tensor, ...]:
    from ..kernels import chunk_prepare as k

    outs = meta.chunk_prepare_fake(a)
    with on_device(a.write_idx):
        k.chunk_prepare(*a[:-1], *outs)  # all but seq_chunks
    return outs


@_chunk_prepare.reference
def _chunk_prepare_cpu(a) -> tuple[Tensor, ...]:
    if a.chunks is not None:
        prep = reference.chunk_prepare_varlen_reference(*a)
    else:
        prep = reference.chunk_prepare_reference(*a[:-2])
    # Pair lists that mark every chunk for the dense kernels: right for any backward.
    count, entries = meta.chunk_prepare_fake(a)[len(layout.Prepared._fields) :]
    return (*(x.contiguous() for x in prep), count.fill_(-1), entries.zero_())


chunk_prepare = _chunk_prepare.op


# ---------------------------------------------------------------------------
# sdm_internal::bank_copy
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::bank_copy", on="bank", fake=meta.bank_copy_fake)
def _bank_copy(bank: Tensor, banks: int, programs: int = 0) -> Tensor:
    """The per-stream copy [banks, H, S, D] (contiguous) of an initial bank, [banks, H, S, D]
    or shared [H, S, D]: the state phase 2 updates in place and returns. A kernel rather than
    a memcpy (see ``kernels/bank_copy.py``); not differentiable (the inference forward's).
    ``programs`` > 0 bounds the kernel's programs a bank, for a copy run beside other kernels
    (the same result)."""


@_bank_copy.kernels
def _bank_copy_kernels(a) -> Tensor:
    from ..kernels import bank_copy as k

    bank_out = meta.bank_copy_fake(a)
    with on_device(a.bank):
        k.bank_copy(a.bank, bank_out, a.programs)
    return bank_out


@_bank_copy.reference
def _bank_copy_cpu(a) -> Tensor:
    return a.bank.expand(a.banks, *a.bank.shape[-3:]).clone(memory_format=torch.contiguous_format)


bank_copy = _bank_copy.op


# ---------------------------------------------------------------------------
# sdm_internal::recurrence_fwd: phase 2
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::recurrence_fwd", on="v", fake=meta.recurrence_fwd_fake)
def _recurrence_fwd(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    read_rank: Tensor,
    X: Tensor,
    QX: Tensor,
    bank: Tensor,
    snapshot: str,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
    write_src: Tensor | None = None,
    read_src: Tensor | None = None,
    row_slots: Tensor | None = None,
    copy_unwritten: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 2: (out, bank_out, snap, snap_scale, res, delta) from the initial ``bank``
    ([B, H, S, D] or shared [H, S, D]); see ``kernels/recurrence_fwd.py``. ``read_rank`` is
    not read here: it is an input so that the backward has it. The kernels copy into bank_out
    only the rows that no chunk writes; phase 2 reads the others from ``bank`` until their
    first write (``kernels/bank_copy.py``).

    With ``row_slots`` (``working_set.working_rows``) ``write_idx`` and ``read_idx`` hold the
    entries' rows in a working set and ``write_src`` and ``read_src`` their slots in ``bank``:
    bank_out is the working set at the end, ``[banks, H, U, D]``, of which only the written
    rows are defined, and nothing is copied. ``snapshot`` may also be ``SKIP_SNAPSHOT``: no
    snapshot, and snap, snap_scale, res and delta are empty (a forward without backward).
    Without ``copy_unwritten`` (a call that returns no final state, on the slots themselves)
    the rows no chunk writes are not copied either: bank_out holds only the written rows."""


@_recurrence_fwd.kernels
def _recurrence_fwd_kernels(a) -> tuple[Tensor, ...]:
    from ..kernels import bank_copy as kc
    from ..kernels import recurrence_fwd as k

    out, bank_out, snap, snap_scale, res, delta = meta.recurrence_fwd_fake(a)
    # Each row's first writing chunk: [streams, S], or row_slots' [P, U] on a working set.
    first = a.write_idx.new_empty(bank_out.shape[:2].numel(), bank_out.shape[2], dtype=torch.int32)
    keep = a.snapshot != SKIP_SNAPSHOT
    with on_device(a.v):
        kc.first_writes(a.write_idx, a.X.shape[-1], a.chunks, a.seq_chunks, first)
        if a.row_slots is None and a.copy_unwritten:
            # Phase 2 reads each row from the input bank until its stream first writes it, so
            # only the rows that no chunk writes are copied.
            kc.bank_copy_unwritten(a.bank, bank_out, first)
        k.recurrence_fwd(
            *a[:9],  # v .. rank
            a.X,
            a.QX,
            bank_out,
            out,
            res=res if keep else None,
            delta=delta if keep else None,
            snap=snap,
            snap_scale=snap_scale,
            snapshot=a.snapshot if keep else None,
            chunks=a.chunks,
            seq_chunks=a.seq_chunks,
            source=a.bank,
            first=first,
            write_src=a.write_src,
            read_src=a.read_src,
        )
    return out, bank_out, snap, snap_scale, res, delta


@_recurrence_fwd.reference
def _recurrence_fwd_cpu(a) -> tuple[Tensor, ...]:
    """The reference, on the working set's rows (gathered from the bank) when given
    ``row_slots``."""
    bank = a.bank
    if a.row_slots is not None:
        banks = a.v.shape[0] if a.seq_chunks is None else a.seq_chunks.shape[0] - 1
        bank = working_set.gather_rows(bank, a.row_slots, banks, a.v.shape[2])
    mode = "none" if a.snapshot == SKIP_SNAPSHOT else a.snapshot
    args = (a.v, a.beta, a.write_idx, a.read_idx, _prepared(a), a.X, a.QX, bank, mode)
    if a.chunks is not None:
        res = reference.recurrence_fwd_varlen_reference(*args, a.chunks, a.seq_chunks)
    else:
        res = reference.recurrence_fwd_reference(*args)
    out, bank_out, snap, snap_scale, resid, delta = res
    if a.snapshot == SKIP_SNAPSHOT:
        snap, snap_scale, resid, delta = (x.new_empty(0) for x in (snap, snap_scale, resid, delta))
    return (
        out.to(a.v.dtype).contiguous(),
        bank_out.to(bank.dtype).contiguous(),
        snap.contiguous(),
        snap_scale.contiguous(),
        resid.contiguous(),
        delta.contiguous(),
    )


recurrence_fwd = _recurrence_fwd.op


# ---------------------------------------------------------------------------
# sdm_internal::recurrence_fwd_: phase 2 in place
# ---------------------------------------------------------------------------


@kernel_op(
    "sdm_internal::recurrence_fwd_",
    on="v",
    mutates_args=("bank",),
    twin="recurrence_fwd_inplace",
    fake=meta.recurrence_fwd_inplace_fake,
)
def _recurrence_fwd_(
    bank: Tensor,
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    X: Tensor,
    QX: Tensor,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> Tensor:
    """Phase 2 updating ``bank`` [B, H, S, D] in place, keeping nothing for a backward; returns
    out [B, T, H, D] in v's dtype."""


@_recurrence_fwd_.kernels
def _recurrence_fwd_inplace_kernels(a) -> Tensor:
    from ..kernels import recurrence_fwd as k

    out = meta.recurrence_fwd_inplace_fake(a)
    with on_device(a.v):
        k.recurrence_fwd(
            *a[1:12],  # v .. QX
            a.bank,
            out,
            res=None,
            delta=None,
            snap=None,
            snap_scale=None,
            snapshot=None,
            chunks=a.chunks,
            seq_chunks=a.seq_chunks,
        )
    return out


@_recurrence_fwd_.reference
def _recurrence_fwd_inplace_cpu(a) -> Tensor:
    args = (a.v, a.beta, a.write_idx, a.read_idx, _prepared(a), a.X, a.QX, a.bank)
    # A contiguous bank in the compute dtype is walked where it is: no copy of it is made.
    inplace = a.bank.is_contiguous() and a.bank.dtype == reference.compute_dtype(
        a.v, a.bank, a.gather_w
    )
    if a.chunks is not None:
        out, bank_out = reference.recurrence_fwd_varlen_reference(
            *args, "none", a.chunks, a.seq_chunks, inplace=inplace
        )[:2]
    else:
        out, bank_out = reference.recurrence_fwd_reference(*args, inplace=inplace)[:2]
    if not inplace:
        a.bank.copy_(bank_out)
    return out.to(a.v.dtype).contiguous()


recurrence_fwd_ = _recurrence_fwd_.op


# ---------------------------------------------------------------------------
# sdm_internal::decode_step_: one token, in place
# ---------------------------------------------------------------------------


@kernel_op(
    "sdm_internal::decode_step_",
    on="v",
    mutates_args=("bank",),
    twin="decode_step_inplace",
    fake=meta.decode_step_fake,
)
def _decode_step(
    bank: Tensor,
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None = None,
) -> Tensor:
    """One token (T = 1) of the recurrence on every stream of ``bank`` [B, H, S, D], in place
    and in one launch; returns out [B, 1, H, D] in v's dtype. See ``kernels/decode_step.py``."""


@_decode_step.kernels
def _decode_step_kernels(a) -> Tensor:
    from ..kernels import decode_step as k

    out = meta.decode_step_fake(a)
    with on_device(a.v):
        k.decode_step(**a._asdict(), out=out)
    return out


@_decode_step.reference
def _decode_step_cpu(a) -> Tensor:
    """The reference, stored into ``bank``."""
    out, new, slot = reference.decode_step_reference(*a)
    B, H, S, D = a.bank.shape
    slot = slot.reshape(B * H, -1)
    keep = slot >= 0
    stream = torch.arange(B * H, device=a.bank.device)[:, None].expand_as(slot)
    # Entries on one slot carry the same new row, so the order of the stores does not matter.
    rows = new.reshape(B * H, -1, D)[keep].to(a.bank.dtype)
    a.bank.view(B * H, S, D)[stream[keep], slot[keep]] = rows
    return out.to(a.v.dtype).contiguous()


decode_step_ = _decode_step.op


# ---------------------------------------------------------------------------
# sdm_internal::recurrence_bwd: phase 2's backward
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::recurrence_bwd", on="res", fake=meta.recurrence_bwd_fake)
def _recurrence_bwd(
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    read_rank: Tensor,
    X: Tensor,
    QX: Tensor,
    A: Tensor,
    solve_beta: Tensor,
    res: Tensor,
    delta: Tensor,
    bank_rows: int,
    snap: Tensor,
    snap_scale: Tensor,
    snapshot: str,
    dout: Tensor | None,
    dbank_out: Tensor | None,
    v_dtype: torch.dtype,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward of ``sdm_internal::recurrence_fwd`` and of the WY solve before it, from the
    saved tensors (the bank itself is not needed: ``snap`` holds every row the backward reads;
    ``bank_rows`` is S; ``A`` is phase 1's and ``solve_beta`` the beta the solve ran on, where
    ``beta`` is the walk's): (dv, dbeta, dgather_w, dgather_r, dscatter_w, drow_decay, dA, dQK,
    dbank [B, H, S, D] float32), dbeta with both shares; see ``kernels/recurrence_bwd.py``."""


@_recurrence_bwd.kernels
def _recurrence_bwd_kernels(a) -> tuple[Tensor, ...]:
    from ..kernels import bank_copy as kc
    from ..kernels import recurrence_bwd as k

    dv, dbeta, _, _, _, _, dA, dQK, dbank = meta.recurrence_bwd_fake(a)
    with on_device(a.res):
        if a.dbank_out is None:
            dbank.zero_()
        else:
            kc.bank_copy(a.dbank_out, dbank)
        dgw, dgr, dsw, drd = k.recurrence_bwd(
            *a[:11],  # beta .. QX
            a.res,
            a.delta,
            snap=a.snap,
            snap_scale=a.snap_scale,
            snapshot=a.snapshot,
            dout=a.dout,
            dbank=dbank,
            dv=dv,
            dA=dA,
            dQK=dQK,
            dbeta=dbeta,
            A=a.A,
            solve_beta=a.solve_beta,
            chunks=a.chunks,
            seq_chunks=a.seq_chunks,
        )
    return dv, dbeta, dgw, dgr, dsw, drd, dA, dQK, dbank


@_recurrence_bwd.reference
def _recurrence_bwd_cpu(a) -> tuple[Tensor, ...]:
    B, T, H, D = a.res.shape
    v_like = a.res.new_empty((B, T, H, D))
    args = (v_like, a.beta, a.write_idx, a.read_idx, _prepared(a), a.X, a.QX, a.bank_rows)
    wy = (a.A, a.solve_beta)
    saved = (a.snap, a.snap_scale, a.snapshot, a.res, a.delta, a.dout, a.dbank_out)
    if a.chunks is not None:
        grads = reference.recurrence_bwd_varlen_reference(
            *args, *saved, *wy, a.chunks, a.seq_chunks
        )
    else:
        grads = reference.recurrence_bwd_reference(*args, *saved, *wy)
    dv, rest = grads[0].to(a.v_dtype), grads[1:]
    return (dv.contiguous(),) + tuple(g.contiguous() for g in rest)


recurrence_bwd = _recurrence_bwd.op


# ---------------------------------------------------------------------------
# sdm_internal::rows_to_bank: the bank's gradient from the working set's
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::rows_to_bank", on="grad_rows", fake=meta.rows_to_bank_fake)
def _rows_to_bank(
    grad_rows: Tensor, row_slots: Tensor | None, bank_rows: int, shared: bool
) -> Tensor:
    """The bank's gradient from the working set's: ``grad_rows [banks, H, U, D]`` (its rows'
    slots ``row_slots [banks * H, U]``; None: row u is slot u) placed at their slots of a
    zeroed ``[banks, H, S, D]`` (S = ``bank_rows``), or with ``shared`` summed over the
    banks, in order, into ``[H, S, D]``; see ``kernels/working_set.py``."""


@_rows_to_bank.kernels
def _rows_to_bank_kernels(a) -> Tensor:
    from ..kernels import working_set as k

    dst = meta.rows_to_bank_fake(a)
    with on_device(a.grad_rows):
        dst.zero_()
        k.rows_to_bank(a.grad_rows, a.row_slots, dst)
    return dst


@_rows_to_bank.reference
def _rows_to_bank_cpu(a) -> Tensor:
    return working_set.rows_to_bank_reference(*a, *a.grad_rows.shape[:2])


rows_to_bank = _rows_to_bank.op


# ---------------------------------------------------------------------------
# sdm_internal::chunk_prepare_backward: phase 1's backward
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::chunk_prepare_backward", on="dA", fake=meta.chunk_prepare_backward_fake)
def _chunk_prepare_backward(
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    bank_rows: int,
    dA: Tensor,
    dQK: Tensor,
    d_gather_w: Tensor,
    d_gather_r: Tensor,
    d_scatter_w: Tensor,
    d_row_decay: Tensor,
    pair_count: Tensor,
    pair_entries: Tensor,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``sdm_internal::chunk_prepare``: (d_write_w, d_read_w, d_decay), d_decay
    empty without decay; ``pair_count`` and ``pair_entries`` are the forward's
    ``layout.PairLists`` (the CPU twin does not read them); see ``kernels/chunk_prepare.py``."""


@_chunk_prepare_backward.kernels
def _chunk_prepare_backward_kernels(a) -> tuple[Tensor, Tensor, Tensor]:
    from ..kernels import chunk_prepare as k

    dww, drw, ddc = meta.chunk_prepare_backward_fake(a)
    with on_device(a.dA):
        k.chunk_prepare_bwd(
            *a[:12],  # write_idx .. d_row_decay
            d_write_w=dww,
            d_decay=None if a.decay is None else ddc,
            d_read_w=drw,
            pair_count=a.pair_count,
            pair_entries=a.pair_entries,
            chunks=a.chunks,
        )
    return dww, drw, ddc


@_chunk_prepare_backward.reference
def _chunk_prepare_backward_cpu(a) -> tuple[Tensor, Tensor, Tensor]:
    if a.chunks is not None:
        dww, drw, ddc = reference.chunk_prepare_backward_varlen_reference(*a[:12], *a[-2:])
    else:
        dww, drw, ddc = reference.chunk_prepare_backward_reference(*a[:12])
    ddc = a.write_w.new_empty(0, dtype=dww.dtype) if ddc is None else ddc
    return dww.contiguous(), drw.contiguous(), ddc.contiguous()


chunk_prepare_backward = _chunk_prepare_backward.op
