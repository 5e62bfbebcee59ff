"""The recurrence's public operators: ``sdm::sparse_delta_memory`` (functional, with its
autograd) and ``sdm::sparse_delta_memory_`` (in place). Each body runs phase 1
(``chunk_prepare``), the WY solve and phase 2 (``recurrence_fwd`` / ``recurrence_fwd_``), or one
decode step (``decode_step_``), calling the internal operators' bodies (``ops/phases.py``), with
no host synchronization. Their fakes are in ``sdm_ops/meta/recurrence.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import _finite, working_set
from ..kernels._common import sm_count
from ..layout import SKIP_SNAPSHOT, PairLists, Prepared
from ..meta import recurrence as meta
from . import eager
from ._define import define_op
from .phases import (
    _bank_copy,
    _chunk_prepare,
    _chunk_prepare_backward,
    _decode_step,
    _finite_select,
    _recurrence_bwd,
    _recurrence_fwd,
    _recurrence_fwd_,
    _rows_to_bank,
    _varlen_chunks,
)
from .wy_solve import _wy_solve_pairs


class Phase1(NamedTuple):
    """What phase 1 and the WY solve give phase 2 and its backward (``_phase1``):
    ``chunk_prepare``'s outputs (``Prepared``, then the ``PairLists`` its backward reads), X and
    QX (``[lead, H, N, C, C]``, as A), a packed batch's chunk tables (None otherwise), the beta
    phase 2 reads (NaN where a token's write side is not finite, ``_finite``), and what the
    backward keeps of the selection of finite inputs (``_finite.KEPT_FOR_BACKWARD``)."""

    prep: Prepared
    pairs: PairLists
    X: Tensor
    QX: Tensor
    chunks: Tensor | None
    seq_chunks: Tensor | None
    beta: Tensor | None = None
    finite: list[Tensor] | None = None


class Snapshot(NamedTuple):
    """Phase 2's outputs that its backward reads: the snapshot rows and their scales, and the
    residuals ``res = v - retrieved`` and updates ``delta`` (``recurrence_fwd``)."""

    snap: Tensor
    snap_scale: Tensor
    res: Tensor
    delta: Tensor


# What the functional forward keeps for its backward, in the order of its ``kept`` output:
# phase 1's outputs, the WY solve's and phase 2's saved tensors, the selection of finite inputs
# (``_finite.KEPT_FOR_BACKWARD``); then, for a packed batch, its chunk tables (chunks, seq_chunks)
# and, without the final state, the working set's layout (``working_set.WorkingRows``).
KEPT_FOR_BACKWARD = (
    *Prepared._fields,
    *("pair_" + f for f in PairLists._fields),
    "X",
    "QX",
    *Snapshot._fields,
    *_finite.KEPT_FOR_BACKWARD,
)


def _chunk_betas(beta: Tensor, chunk_size: int, chunks: Tensor | None = None) -> Tensor:
    """beta [B, T, H] -> [B * H * N, C] float32 (float64 for float64 beta), zero past T (the WY
    solve's layout); for a packed batch [H * NC, C] over its chunk slots, zero past each chunk's
    tokens."""
    B, T, H = beta.shape
    C = chunk_size
    wd = torch.promote_types(beta.dtype, torch.float32)
    if chunks is None:
        N = -(-T // C)
        x = beta.to(wd).transpose(1, 2)
        x = torch.nn.functional.pad(x, (0, N * C - T))
        return x.reshape(B * H * N, C)
    NC = chunks.shape[0]
    if T == 0:
        return beta.new_zeros(H * NC, C, dtype=wd)
    i = torch.arange(C, device=beta.device)
    tok = (chunks[:, :1] + i).clamp(max=T - 1)  # [NC, C]
    x = torch.where((i < chunks[:, 1:])[..., None], beta[0].to(wd)[tok], 0.0)
    return x.permute(2, 0, 1).reshape(H * NC, C)


def _wide(idx: Tensor) -> Tensor:
    """``idx`` as int64. Phase 2's walks over several chunks take int64 indices only: with int32
    ones, compiled for the H200 by Triton 3.6, results went wrong from the third chunk of a
    stream on (the interpreter's were right); the widened copy costs 4 bytes an entry."""
    return idx if idx.dtype == torch.int64 else idx.to(torch.int64)


def _phase1(v, beta, write_idx, write_w, read_idx, read_w, decay, S, C, cu_seqlens) -> Phase1:
    """Phase 1 and the WY solve on finite inputs (``_finite.clean``); the read gather weights
    are NaN where a token's read weights are not finite, and the beta for phase 2 NaN where
    its write side is not. The chunk tables are None without ``cu_seqlens``."""
    chunks, seq_chunks = (
        (None, None) if cu_seqlens is None else _varlen_chunks(cu_seqlens, v.shape[1], C)
    )
    selected = _finite_select(beta, write_idx, write_w, read_idx, read_w, decay, S)
    clean_beta, beta_walk, clean_write_w, clean_read_w, clean_decay, bad_reads = selected[:6]
    clean_decay = None if decay is None else clean_decay
    outs = _chunk_prepare(
        write_idx, clean_write_w, read_idx, clean_read_w, clean_decay, S, C, chunks, seq_chunks
    )
    n = len(Prepared._fields)
    prep, pairs = Prepared(*outs[:n]), PairLists(*outs[n:])
    prep = prep._replace(gather_r=_finite.poison_reads(prep.gather_r, bad_reads))
    A = prep.A
    X, QX = _wy_solve_pairs(
        A.view(-1, C, C),
        _chunk_betas(clean_beta, C, chunks),
        prep.QK.view(-1, C, C),
        pairs.count.reshape(-1),
        # [chunks, NP]; NP is 0 where the geometry has no sparse path (``layout.pair_positions``)
        pairs.entries.reshape(pairs.count.numel(), pairs.entries.shape[-1]),
    )
    finite = [*selected[:5], *selected[6:]]  # _finite.KEPT_FOR_BACKWARD
    X, QX = X.view(A.shape), QX.view(A.shape)
    return Phase1(prep, pairs, X, QX, chunks, seq_chunks, beta_walk, finite)


def _phase2_(bank: Tensor, v, beta, write_idx, read_idx, p: Phase1) -> Tensor:
    """Phase 2 in place on ``bank`` (``recurrence_fwd_``), after phase 1 ``p``; returns out."""
    weights = p.prep[2:7]  # gather_w .. rank
    return _recurrence_fwd_(
        bank, v, beta, write_idx, read_idx, *weights, p.X, p.QX, p.chunks, p.seq_chunks
    )


# The inference forward's bank copy beside phase 1 (``_copy_beside``) takes one
# program for every _COPY_SM_SHARE SMs, which copies at about 60% of a whole-GPU copy's speed;
# so it runs beside phase 1 only while the bank holds at most _COPY_BESIDE_BYTES a chunk of
# phase 1 (the reference workload: 256 KiB; S = 2^20 with one batch row: 16 MiB, in order).
_COPY_SM_SHARE = 4
_COPY_BESIDE_BYTES = 512 * 1024
_side_streams: dict[int, torch.cuda.Stream] = {}


def _copy_beside(bank: Tensor, banks: int, chunks: int) -> tuple[Tensor, torch.cuda.Stream | None]:
    """``(bank_out, side)``: the inference forward's copy of the bank, issued on a second
    stream ``side`` so that it runs beside phase 1 and the WY solve (over ``chunks`` chunks),
    latency-bound kernels that leave most of the memory bandwidth idle; the caller makes its
    stream wait for ``side`` before phase 2. The copy runs as one program for every
    ``_COPY_SM_SHARE`` SMs (at least one a bank), so that the other stream's programs find
    whole SMs free. Eager calls and CUDA-graph captures (where the fork becomes two branches of
    the graph) take it; on the CPU, while traced (Inductor schedules one stream) and for a
    bank of more than ``_COPY_BESIDE_BYTES`` a chunk, the copy runs in order, ``side`` None."""
    if (
        not bank.is_cuda
        or eager.traced(bank)
        or banks * bank.shape[-3:].numel() * bank.element_size()
        > _COPY_BESIDE_BYTES * max(chunks, 1)
    ):
        return _bank_copy(bank, banks), None
    dev = bank.device
    side = _side_streams.get(dev.index)
    if side is None:
        side = _side_streams[dev.index] = torch.cuda.Stream(dev)
    here = torch.cuda.current_stream(dev)
    programs = max(1, sm_count(dev) // (_COPY_SM_SHARE * banks))
    side.wait_stream(here)
    with torch.cuda.stream(side):
        bank_out = _bank_copy(bank, banks, programs)
    bank_out.record_stream(here)  # allocated on side, used and freed on here
    return bank_out, side


# ---------------------------------------------------------------------------
# sdm::sparse_delta_memory
# ---------------------------------------------------------------------------


def _sparse_delta_memory(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    bank: Tensor,
    decay: Tensor | None = None,
    chunk_size: int = 64,
    snapshot: str = "none",
    cu_seqlens: Tensor | None = None,
    output_final_state: bool = False,
    *,
    keep_for_backward: bool = True,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The recurrence of ``sdm_ops.sparse_delta_memory``: (out, bank_out, kept). With
    ``keep_for_backward`` phase 2 keeps the snapshots (``snapshot``) and ``kept`` holds what the
    backward reads (``KEPT_FOR_BACKWARD``); without it (what the public function passes when no
    input requires grad) nothing is kept, ``kept`` is empty and phase 2 runs in place on a copy
    of the bank, made on a second stream beside phase 1 and the WY solve on the GPU."""
    v, beta, write_idx, write_w, read_idx, read_w, bank = (
        t.contiguous() for t in (v, beta, write_idx, write_w, read_idx, read_w, bank)
    )
    write_idx, read_idx = _wide(write_idx), _wide(read_idx)
    decay = None if decay is None else decay.contiguous()
    B, T, H, _ = v.shape
    S, C = bank.shape[-2], chunk_size
    in_place = not keep_for_backward and output_final_state
    if in_place:
        banks = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        bank_out, side = _copy_beside(bank, banks, B * H * -(-T // C))
    p = _phase1(v, beta, write_idx, write_w, read_idx, read_w, decay, S, C, cu_seqlens)
    if in_place:
        if side is not None:
            torch.cuda.current_stream(bank.device).wait_stream(side)
        return _phase2_(bank_out, v, p.beta, write_idx, read_idx, p), bank_out, []
    # Without the final state, phase 2 runs on the rows the sequence touches: a numbered working
    # set, or the slots themselves where that would be as large as the bank
    # (``working_set.numbers_rows``).
    numbered = working_set.numbers_rows(
        T, write_idx.shape[-1], read_idx.shape[-1], S, output_final_state
    )
    rows = working_set.working_rows(write_idx, read_idx, S, cu_seqlens) if numbered else None
    out, bank_out, *saved = _recurrence_fwd(
        v,
        p.beta,
        write_idx if rows is None else rows.write_rows,
        read_idx if rows is None else rows.read_rows,
        *p.prep[2:],  # gather_w .. read_rank
        p.X,
        p.QX,
        bank,
        snapshot if keep_for_backward else SKIP_SNAPSHOT,
        p.chunks,
        p.seq_chunks,
        write_src=None if rows is None else write_idx,
        read_src=None if rows is None else read_idx,
        row_slots=None if rows is None else rows.row_slots,
        copy_unwritten=output_final_state,
    )
    if not keep_for_backward:
        return out, bank.new_empty(0), []
    kept = [*p.prep, *p.pairs, p.X, p.QX, *saved, *p.finite]
    if cu_seqlens is not None:
        kept += [p.chunks, p.seq_chunks]
    if rows is not None:
        kept += list(rows)
    return out, bank_out if output_final_state else bank.new_empty(0), kept


sparse_delta_memory = define_op(
    "sdm::sparse_delta_memory", _sparse_delta_memory, fake=meta.sparse_delta_memory_fake
)


def _sparse_delta_memory_setup(ctx, inputs, keyword_only_inputs, output):
    v, beta, write_idx, write_w, read_idx, read_w, bank, decay, chunk_size, snapshot = inputs[:10]
    kept = output[2]
    ctx.mark_non_differentiable(*kept)
    # out or the bank may get no gradient: no zero tensors are made for them (None reaches the
    # backward).
    ctx.set_materialize_grads(False)
    ctx.keep_for_backward = keyword_only_inputs["keep_for_backward"]
    ctx.final_state = inputs[11]  # output_final_state
    T, W, R = v.shape[1], write_idx.shape[-1], read_idx.shape[-1]
    ctx.working_set = working_set.numbers_rows(T, W, R, bank.shape[-2], ctx.final_state)
    ctx.chunk_size, ctx.snapshot, ctx.bank_rows = chunk_size, snapshot, bank.shape[-2]
    ctx.v_dtype, ctx.bank_meta = v.dtype, (bank.dim(), bank.dtype)
    ctx.has_decay = decay is not None
    if ctx.keep_for_backward:
        # The float inputs themselves are not kept: ``kept`` holds the clean values the forward
        # ran on, which the backward takes (``_finite.KEPT_FOR_BACKWARD``).
        ctx.save_for_backward(write_idx, read_idx, *kept)


def _unpack_kept(kept: list[Tensor], working: bool):
    """(Phase1, Snapshot, WorkingRows or None) from the forward's ``kept`` tensors (in the order
    of ``KEPT_FOR_BACKWARD``, then the chunk tables, then the working set's layout when
    ``working``)."""
    n = len(Prepared._fields)
    m = n + len(PairLists._fields) + 2 + len(Snapshot._fields)
    prep, pairs, (X, QX), saved = kept[:n], kept[n : n + 2], kept[n + 2 : n + 4], kept[n + 4 : m]
    finite, tables = kept[m : len(KEPT_FOR_BACKWARD)], kept[len(KEPT_FOR_BACKWARD) :]
    rows = None
    if working:
        rows = working_set.WorkingRows(*tables[-3:])
        tables = tables[:-3]
    chunks, seq_chunks = tables or (None, None)
    p = Phase1(Prepared(*prep), PairLists(*pairs), X, QX, chunks, seq_chunks, finite[1], finite)
    return p, Snapshot(*saved), rows


def _sparse_delta_memory_grad(ctx, dout, dbank_out, _kept):
    """Phase 2's backward with the WY solve's (``recurrence_bwd``: dA, dQK and both of beta's
    shares from the walk's du and the forward's delta), then, for the inputs that need them,
    phase 1's (``chunk_prepare_backward``)."""
    eager.no_double_backward("sparse_delta_memory")
    if not ctx.keep_for_backward:
        raise RuntimeError(
            "sdm::sparse_delta_memory ran with keep_for_backward=False, which keeps nothing for "
            "a backward; call it with keep_for_backward=True to differentiate it "
            "(sdm_ops.sparse_delta_memory does so whenever an input requires grad)"
        )
    write_idx, read_idx, *kept = ctx.saved_tensors
    p, saved, rows = _unpack_kept(kept, ctx.working_set)
    if dbank_out is not None and dbank_out.numel() == 0:  # no final state was returned
        dbank_out = None
    write_idx, read_idx = _wide(write_idx.contiguous()), _wide(read_idx.contiguous())
    # What the forward ran on (``_finite``); inputs it selected away get no gradient.
    selected, clean = _finite.kept_selection(p.finite, ctx.has_decay)
    beta, write_w, read_w, decay = clean.beta, clean.write_w, clean.read_w, clean.decay
    # Which of (v, beta, write_idx, write_w, read_idx, read_w, bank, decay) need a gradient (the
    # dispatcher passes no argument left at its default, so the tuple may be shorter).
    needs = (tuple(ctx.needs_input_grad[:8]) + (False,) * 8)[:8]
    # The internal operators' bodies, eagerly (``eager.in_backward``).
    direct = eager.eager_backward(beta)
    dv, dbeta, dgw, dgr, dsw, drd, dA, dQK, dbank = eager.in_backward(_recurrence_bwd, direct)(
        clean.beta_walk,
        write_idx if rows is None else rows.write_rows,
        read_idx if rows is None else rows.read_rows,
        *p.prep[2:],  # gather_w .. read_rank
        p.X,
        p.QX,
        p.prep.A,
        beta,
        saved.res,
        saved.delta,
        ctx.bank_rows if rows is None else rows.row_slots.shape[1],
        saved.snap,
        saved.snap_scale,
        ctx.snapshot,
        dout=None if dout is None else dout.contiguous(),
        dbank_out=None if dbank_out is None else dbank_out.contiguous(),
        v_dtype=ctx.v_dtype,
        chunks=p.chunks,
        seq_chunks=p.seq_chunks,
    )
    bank_dim, bank_dtype = ctx.bank_meta
    if rows is not None:
        if needs[6]:
            to_bank = eager.in_backward(_rows_to_bank, direct)
            dbank = to_bank(dbank, rows.row_slots, ctx.bank_rows, bank_dim == 3)
    elif bank_dim == 3 and not ctx.final_state:
        if needs[6]:  # the slots as rows: the batch summed in order, as from a working set
            to_bank = eager.in_backward(_rows_to_bank, direct)
            dbank = to_bank(dbank, None, ctx.bank_rows, True)
    elif bank_dim == 3:
        dbank = dbank.sum(0)
    dww = drw = ddc = None
    if needs[3] or needs[5] or needs[7]:
        wd = meta.weight_dtype(write_w, read_w, decay)
        dww, drw, ddc = eager.in_backward(_chunk_prepare_backward, direct)(
            write_idx,
            write_w,
            read_idx,
            read_w,
            decay,
            ctx.bank_rows,
            *(g.to(wd) for g in (dA, dQK, dgw, dgr, dsw, drd)),
            *p.pairs,
            p.chunks,
            p.seq_chunks,
        )
    grads = (
        dv if needs[0] else None,
        selected.keep_beta(dbeta.to(beta.dtype)) if needs[1] else None,
        None,
        selected.keep_write_w(dww.to(write_w.dtype)) if needs[3] else None,
        None,
        selected.keep_read_w(drw.to(read_w.dtype)) if needs[5] else None,
        dbank.to(bank_dtype) if needs[6] else None,
        selected.keep_decay(ddc.to(decay.dtype)) if needs[7] else None,
    )
    # One gradient for each argument the dispatcher passed (chunk_size and the others get None).
    return (grads + (None,) * 4)[: len(ctx.needs_input_grad)]


sparse_delta_memory_route = eager.route(
    "sdm::sparse_delta_memory",
    sparse_delta_memory,
    _sparse_delta_memory,
    setup=_sparse_delta_memory_setup,
    backward=_sparse_delta_memory_grad,
    kw_only=("keep_for_backward",),
    listed=2,
)


# ---------------------------------------------------------------------------
# sdm::sparse_delta_memory_
# ---------------------------------------------------------------------------


def _inplace_chunk_size(T, chunk_size: int):
    """``chunk_size`` (16, 32, 64 or 128), or for a sequence shorter than it the smallest of
    those sizes that holds it: a short prefill runs in one small chunk."""
    C = chunk_size
    while C > 16 and C // 2 >= T:
        C //= 2
    return C


def _sparse_delta_memory_(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    bank: Tensor,
    decay: Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """The recurrence of ``sdm_ops.sparse_delta_memory_``, updating ``bank`` [B, H, S, D] in
    place and keeping nothing for a backward; returns out. One token per stream (T = 1, no
    ``cu_seqlens``) is one decode step (``decode_step_``); a sequence shorter than
    ``chunk_size`` runs in chunks of the smallest size that holds it (``_inplace_chunk_size``)."""
    v, beta, write_idx, write_w, read_idx, read_w = (
        t.contiguous() for t in (v, beta, write_idx, write_w, read_idx, read_w)
    )
    if v.shape[1] != 1 or cu_seqlens is not None:
        write_idx, read_idx = _wide(write_idx), _wide(read_idx)
    decay = None if decay is None else decay.contiguous()
    state = bank.contiguous()
    T = v.shape[1]
    entries = (write_idx, write_w, read_idx, read_w, decay)
    if T == 1 and cu_seqlens is None:  # a decode step: one kernel, no chunk machinery
        # The step's body, not its operator: a second dispatch would double the host cost of
        # an eager step, and a traced graph sees the same kernel either way.
        out = _decode_step(state, v, beta, *entries)
    else:
        C = _inplace_chunk_size(T, chunk_size)
        p = _phase1(v, beta, *entries, bank.shape[-2], C, cu_seqlens)
        out = _phase2_(state, v, p.beta, write_idx, read_idx, p)
    if state is not bank:  # a bank of another dense layout: updated through a copy
        bank.copy_(state)
    return out


sparse_delta_memory_ = define_op(
    "sdm::sparse_delta_memory_",
    _sparse_delta_memory_,
    fake=meta.sparse_delta_memory_inplace_fake,
    mutates_args=("bank",),
)
sparse_delta_memory_inplace_route = eager.route(
    "sdm::sparse_delta_memory_", sparse_delta_memory_, _sparse_delta_memory_, mutated=(6,)
)
