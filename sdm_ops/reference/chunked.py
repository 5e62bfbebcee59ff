"""The chunked recurrence: phase 1 (chunk_prepare) and its backward, the snapshot
quantization, the bank walk forward and backward, and the chunked oracle."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..layout import FP8_MAX, INT4_MAX, QUANT_GROUP, ChunkWeights, Prepared
from ._common import (
    _chunked,
    _entries,
    _gather_rows,
    _unchunked,
    before,
    compute_dtype,
    first_bad,
    from_streams,
    to_streams,
)
from .wy import wy_solve_reference


class _ChunkEntries(NamedTuple):
    """A chunk's entries flattened token-major (E = C * W write, Er = C * R read entries), with
    the slot-match matrices that phase 1 and its backward are built from."""

    s_b: Tensor  # [P, E] write slots, -1 for padding
    w_b: Tensor  # [P, E] write weights (0 for padding)
    d_b: Tensor  # [P, E] decays (1 for padding)
    s_r: Tensor  # [P, Er] read slots
    w_r: Tensor  # [P, Er] read weights
    ok_b: Tensor
    ok_r: Tensor
    same: Tensor  # [P, E, E] write entries on one slot
    rsame: Tensor  # [P, Er, E] read entry and write entry on one slot
    slot: Tensor  # [P, C, W]
    rslot: Tensor  # [P, C, R]


def _chunk_entries(write_idx, write_w, read_idx, read_w, decay, s: int) -> _ChunkEntries:
    P, C, W = write_idx.shape
    R = read_idx.shape[-1]
    if decay is None:
        decay = torch.ones_like(write_w)
    slot, w, dec = _entries(write_idx, write_w, s, decay)
    rslot, rw, _ = _entries(read_idx, read_w, s)
    s_b, w_b, d_b = slot.reshape(P, C * W), w.reshape(P, C * W), dec.reshape(P, C * W)
    s_r, w_r = rslot.reshape(P, C * R), rw.reshape(P, C * R)
    ok_b, ok_r = s_b >= 0, s_r >= 0
    same = (s_b[:, :, None] == s_b[:, None, :]) & ok_b[:, :, None] & ok_b[:, None, :]
    rsame = (s_r[:, :, None] == s_b[:, None, :]) & ok_r[:, :, None] & ok_b[:, None, :]
    return _ChunkEntries(s_b, w_b, d_b, s_r, w_r, ok_b, ok_r, same, rsame, slot, rslot)


def chunk_weights(write_idx, write_w, read_idx, read_w, decay, s: int) -> ChunkWeights:
    """Phase 1 of the chunked form for one chunk of every stream (inputs [P, C, W] / [P, C, R])."""
    P, C, W = write_idx.shape
    R = read_idx.shape[-1]
    cd = write_w.dtype
    ce = _chunk_entries(write_idx, write_w, read_idx, read_w, decay, s)
    s_b, w_b, d_b, s_r, w_r, ok_b, ok_r, same, rsame, slot, rslot = ce
    E, Er = C * W, C * R
    tok = torch.arange(C, device=slot.device)
    tok_b, tok_r = tok.repeat_interleave(W), tok.repeat_interleave(R)
    one = torch.ones((), dtype=cd, device=slot.device)
    # dec_on[x, t]: decay that token t applies to the slot of entry x (product over its entries).
    dec_on = torch.where(same, d_b[:, None, :], one).reshape(P, E, C, W).prod(-1)  # [P, E, C]
    rdec_on = torch.where(rsame, d_b[:, None, :], one).reshape(P, Er, C, W).prod(-1)  # [P, Er, C]
    # since[b, i] = Gamma_{i/j} on b's slot, j = b's token (1 for i <= j).
    since = torch.cumprod(torch.where(tok[None, None, :] > tok_b[None, :, None], dec_on, one), -1)
    upto = torch.cumprod(dec_on, -1)  # [P, E, C]
    rupto = torch.cumprod(rdec_on, -1)
    gather_w = w_b * upto.gather(2, tok_b.expand(P, E)[..., None]).squeeze(-1)
    gather_r = w_r * rupto.gather(2, tok_r.expand(P, Er)[..., None]).squeeze(-1)
    scatter_w = w_b * since[..., C - 1]
    row_decay = upto[..., C - 1]
    # Pair terms: w_a w_b Gamma_{i/j} for entries a (token i) and b (token j) on one slot.
    since_at_a = since.transpose(1, 2)[:, tok_b, :]  # [P, E(a), E(b)]
    pair = torch.where(same, w_b[:, :, None] * w_b[:, None, :] * since_at_a, 0)
    A = torch.tril(pair.reshape(P, C, W, C, W).sum((2, 4)), -1)
    since_at_r = since.transpose(1, 2)[:, tok_r, :]
    rpair = torch.where(rsame, w_r[:, :, None] * w_b[:, None, :] * since_at_r, 0)
    QK = torch.tril(rpair.reshape(P, C, R, C, W).sum((2, 4)))
    earlier = torch.arange(E, device=slot.device)
    rank = (same & (earlier[None, None, :] < earlier[None, :, None])).sum(-1)
    rearlier = torch.arange(Er, device=slot.device)
    rr = (s_r[:, :, None] == s_r[:, None, :]) & ok_r[:, :, None] & ok_r[:, None, :]
    read_rank = (rr & (rearlier[None, None, :] < rearlier[None, :, None])).sum(-1)
    return ChunkWeights(
        A,
        QK,
        gather_w.reshape(P, C, W),
        gather_r.reshape(P, C, R),
        scatter_w.reshape(P, C, W),
        row_decay.reshape(P, C, W),
        rank.reshape(P, C, W),
        read_rank.reshape(P, C, R),
        slot,
        rslot,
    )


def chunk_prepare_reference(
    write_idx, write_w, read_idx, read_w, decay, bank_rows: int, chunk_size: int, *, slab: int = 256
) -> Prepared:
    """Phase 1 (bank-free) for all chunks, ``slab`` chunks at a time (bounded memory)."""
    cd = compute_dtype(write_w, read_w, decay)
    B, T, H, W = write_idx.shape
    P, C = B * H, chunk_size
    wi = _chunked(to_streams(write_idx), C, -1)
    ww = _chunked(to_streams(write_w.to(cd)), C, 0)
    ri = _chunked(to_streams(read_idx), C, -1)
    rw = _chunked(to_streams(read_w.to(cd)), C, 0)
    dc = None if decay is None else _chunked(to_streams(decay.to(cd)), C, 1)
    parts = [
        chunk_weights(
            wi[i : i + slab],
            ww[i : i + slab],
            ri[i : i + slab],
            rw[i : i + slab],
            None if dc is None else dc[i : i + slab],
            bank_rows,
        )
        for i in range(0, wi.shape[0], slab)
    ]
    cw = ChunkWeights(*(torch.cat(f, 0) if parts else None for f in zip(*parts))) if parts else None
    N = wi.shape[0] // max(P, 1) if P else 0
    if cw is None:  # T == 0 (or no streams)
        z = torch.zeros(B, H, 0, C, C, dtype=cd, device=write_idx.device)
        e = write_w.new_zeros(B, T, H, W, dtype=cd)
        R = read_idx.shape[-1]
        return Prepared(
            z,
            z.clone(),
            e,
            read_w.new_zeros(B, T, H, R, dtype=cd),
            e.clone(),
            e + 1,
            torch.zeros(B, T, H, W, dtype=torch.int32, device=e.device),
            torch.zeros(B, T, H, R, dtype=torch.int32, device=e.device),
        )

    def entries(x):
        return from_streams(_unchunked(x, P, T), B, H)

    return Prepared(
        cw.A.reshape(B, H, N, C, C),
        cw.QK.reshape(B, H, N, C, C),
        entries(cw.gather_w),
        entries(cw.gather_r),
        entries(cw.scatter_w),
        entries(cw.row_decay),
        entries(cw.rank).to(torch.int32),
        entries(cw.read_rank).to(torch.int32),
    )


def quantize_rows(rows: Tensor, mode: str, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Snapshot rows [..., D] (float32) in ``mode``: (codes, scales [..., D / 16] or empty).

    none: the rows unchanged (callers store them in the bank dtype); bf16: rounded to bfloat16;
    fp8: float8_e4m3fn codes of rows / scale, with scale = amax / 448 per group of 16 columns,
    stored as their bit patterns (uint8);
    int4: round-half-up(rows / scale) in [-7, 7], scale = amax / 7, stored + 8 two per byte
    (even column in the low nibble). A group of zeros gets scale 1.
    ``scale`` [..., D / 16], if given, replaces the groups' own scales (fp8, int4).

    On a GPU the kernels divide with the device's float32 division, which may differ from a
    correctly rounded quotient by up to 2 ulp: scales and the codes of values within that of a
    rounding boundary can differ from these. The decoder reads the stored scale, so what the
    backward sees is always ``dequantize_rows`` of what was stored.
    """
    if mode in ("none", "bf16"):
        return (rows if mode == "none" else rows.to(torch.bfloat16)), rows.new_zeros(0)
    d = rows.shape[-1]
    g = rows.reshape(*rows.shape[:-1], d // QUANT_GROUP, QUANT_GROUP)
    top = FP8_MAX if mode == "fp8" else INT4_MAX
    if scale is None:
        amax = g.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    else:
        scale = scale[..., None]
    x = g / scale
    if mode == "fp8":
        codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(rows.shape)
        codes = codes.view(torch.uint8)
    else:
        q = torch.floor(x + 0.5).clamp(-INT4_MAX, INT4_MAX) + 8
        q = q.to(torch.uint8).reshape(rows.shape)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return codes, scale.squeeze(-1).to(torch.float32)


def dequantize_rows(codes: Tensor, scale: Tensor, mode: str) -> Tensor:
    """Inverse of :func:`quantize_rows` (float32 rows)."""
    if mode in ("none", "bf16"):
        return codes.to(torch.float32)
    if mode == "fp8":
        x = codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        lo = (codes & 15).to(torch.float32) - 8
        hi = (codes >> 4).to(torch.float32) - 8
        x = torch.stack((lo, hi), -1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    # The group count spelled out: -1 is ambiguous for no rows (T = 0, or no entries).
    g = x.reshape(*x.shape[:-1], x.shape[-1] // QUANT_GROUP, QUANT_GROUP) * scale[..., None]
    return g.reshape(x.shape)


def recurrence_fwd_reference(
    v,
    beta,
    write_idx,
    read_idx,
    prep: Prepared,
    X,
    QX,
    bank,
    snapshot: str = "none",
    *,
    inplace: bool = False,
):
    """Phase 2 (gathers, dual matmul, decay and write) for all chunks, given phase 1 and the
    WY solve (X, QX: [B, H, N, C, C]).

    Returns (out [B, T, H, D], bank [B, H, S, D], snap, snap_scale, res [B, T, H, D], delta
    [B, T, H, D]) where snap holds the chunk-start bank row of every write entry, then of every
    read entry, [B, T, H, W + R, D] (zeros for padding), quantized by :func:`quantize_rows`:
    every bank row the backward reads. res = v - retrieved and
    delta = X (beta res). out, res, delta and the bank are in the compute dtype.

    With ``inplace`` (a contiguous [B, H, S, D] bank in the compute dtype) the walk updates
    ``bank`` itself and returns it: no copy of the bank is made.
    """
    cd = compute_dtype(v, bank, prep.gather_w)
    B, T, H, D = v.shape
    S = bank.shape[-2]
    P = B * H
    C = X.shape[-1]
    if inplace:
        M = bank.view(P, S, D)
    else:
        M = bank.to(cd).expand(B, H, S, D).reshape(P, S, D).clone()  # never the input itself
    vs, bs = _chunked(to_streams(v.to(cd)), C, 0), _chunked(to_streams(beta.to(cd)), C, 0)
    slot = _chunked(to_streams(_entries(write_idx, write_idx, S)[0]), C, -1)
    rslot = _chunked(to_streams(_entries(read_idx, read_idx, S)[0]), C, -1)
    gw, sw = _chunked(to_streams(prep.gather_w), C, 0), _chunked(to_streams(prep.scatter_w), C, 0)
    rd, gr = _chunked(to_streams(prep.row_decay), C, 1), _chunked(to_streams(prep.gather_r), C, 0)
    first = _chunked(to_streams(prep.rank), C, 1) == 0
    N = vs.shape[0] // P if P else 0
    Xs, QXs = X.reshape(P, N, C, C), QX.reshape(P, N, C, C)
    outs, snaps, resids, deltas = [], [], [], []
    for n in range(N):
        c = torch.arange(P, device=v.device) * N + n
        sl, rsl = slot[c], rslot[c]
        wrows = _gather_rows(M, sl.reshape(P, -1)).reshape(P, C, -1, D)
        rrows = _gather_rows(M, rsl.reshape(P, -1)).reshape(P, C, -1, D)
        retrieved = (gw[c][..., None] * wrows).sum(2)
        inter = (gr[c][..., None] * rrows).sum(2)
        # A token that writes nothing adds nothing; the products run on the tokens before
        # the first whose update or read is not finite (sdm_ops/_finite.py).
        writes = (sl >= 0).any(-1)
        resid = torch.where(writes[..., None], vs[c] - retrieved, 0)
        u = bs[c][..., None] * resid
        f_w = first_bad(u, writes)
        f_o = torch.minimum(f_w, first_bad(inter, (rsl >= 0).any(-1)))
        u = torch.where(before(f_w, C), u, 0)
        delta = torch.where(before(f_w, C), Xs[:, n] @ u, float("nan"))
        outs.append(torch.where(before(f_o, C), inter + QXs[:, n] @ u, float("nan")))
        snaps.append(torch.cat([wrows, rrows], 2))
        resids.append(resid)
        deltas.append(delta)
        # Decay and write: the first entry on a slot also moves its row by (Gamma_C - 1) M_0.
        add = sw[c][..., None] * delta[:, :, None, :]
        add = add + torch.where(first[c][..., None], (rd[c][..., None] - 1) * wrows, 0)
        flat = sl.reshape(P, -1)
        add = torch.where((flat >= 0)[..., None], add.reshape(P, -1, D), 0)
        at = flat.clamp(min=0)[..., None].expand(P, flat.shape[1], D)
        M = M.scatter_add_(1, at, add) if inplace else M.scatter_add(1, at, add)

    def tokens(parts, *shape):
        if not parts:
            return v.new_zeros(B, T, H, *shape, dtype=cd)
        x = torch.stack(parts, 1).reshape(P * N, C, *shape)
        return from_streams(_unchunked(x, P, T), B, H)

    rows = tokens(snaps, write_idx.shape[-1] + read_idx.shape[-1], D)
    snap, snap_scale = quantize_rows(
        rows.to(torch.float32) if snapshot != "none" else rows, snapshot
    )
    if snapshot == "none":
        snap = snap.to(bank.dtype if cd == torch.float32 else cd)
    return (
        tokens(outs, D),
        M.reshape(B, H, S, D),
        snap,
        snap_scale,
        tokens(resids, D),
        tokens(deltas, D),
    )


def sdm_chunked_reference(
    v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None, chunk_size: int = 64
):
    """The chunked form: phase 1, the WY solve and phase 2, vectorized over streams.

    v [B, T, H, D]; beta [B, T, H]; write_idx, write_w, decay [B, T, H, W]; read_idx, read_w
    [B, T, H, R]; bank [B, H, S, D] or [H, S, D]. Returns (out [B, T, H, D], bank [B, H, S, D])
    in the compute dtype (float64 if any input is float64, else float32). Differentiable.
    """
    cd = compute_dtype(v, bank, write_w, read_w, beta, decay)
    B, T, H, _ = v.shape
    C = chunk_size
    prep = chunk_prepare_reference(
        write_idx,
        write_w.to(cd),
        read_idx,
        read_w.to(cd),
        None if decay is None else decay.to(cd),
        bank.shape[-2],
        C,
    )
    N = prep.A.shape[2]
    betas = _chunked(to_streams(beta.to(cd)), C, 0) if T else beta.new_zeros(0, C, dtype=cd)
    X, QX = wy_solve_reference(
        prep.A.reshape(-1, C, C), betas.reshape(-1, C), prep.QK.reshape(-1, C, C)
    )
    X, QX = X.reshape(B, H, N, C, C), QX.reshape(B, H, N, C, C)
    out, M = recurrence_fwd_reference(v, beta, write_idx, read_idx, prep, X, QX, bank)[:2]
    return out, M


def recurrence_bwd_reference(
    v,
    beta,
    write_idx,
    read_idx,
    prep: Prepared,
    X,
    QX,
    bank_rows: int,
    snap,
    snap_scale,
    snapshot: str,
    res,
    delta,
    dout,
    dbank_out,
    A,
    solve_beta,
):
    """Backward of :func:`recurrence_fwd_reference`, walking the chunks in reverse, and of the
    WY solve before it.

    Every bank row it reads (the chunk-start row of each write and read entry) comes from
    ``snap`` (dequantized), so the rows seen are the forward's up to the snapshot's rounding;
    ``bank_rows`` is S. ``res = v - retrieved`` and ``delta`` are the forward's; ``A`` is phase
    1's and ``solve_beta`` the beta the WY solve ran on (``beta`` is the walk's).
    Returns (dv, dbeta, dgather_w, dgather_r, dscatter_w, drow_decay, dA, dQK, dbank [B, H, S, D]).
    drow_decay is non-zero only on the first entry of each slot (the one the forward reads).
    Through the solve: with delta = X u and QX u = tril(QK) delta, du is X^T times the gradient
    reaching delta, so dL = -du delta^T (strict lower triangle), dA = solve_beta dL,
    dQK = tril(dout delta^T), and dbeta gains rowsum(dL * A).
    """
    cd = compute_dtype(v, X, prep.gather_w)
    B, T, H, D = v.shape
    S = bank_rows
    P = B * H
    C = X.shape[-1]
    dM = (
        torch.zeros(P, S, D, dtype=cd, device=v.device)
        if dbank_out is None
        else dbank_out.to(cd).reshape(P, S, D).clone()
    )
    dout = torch.zeros(B, T, H, D, dtype=cd, device=v.device) if dout is None else dout.to(cd)
    rows = dequantize_rows(snap, snap_scale, snapshot).to(cd) if snapshot != "none" else snap.to(cd)

    def chunks(x, fill):
        return _chunked(to_streams(x), C, fill)

    slot = chunks(_entries(write_idx, write_idx, S)[0], -1)
    rslot = chunks(_entries(read_idx, read_idx, S)[0], -1)
    gw, sw = chunks(prep.gather_w.to(cd), 0), chunks(prep.scatter_w.to(cd), 0)
    rd = chunks(prep.row_decay.to(cd), 1)
    gr = chunks(prep.gather_r.to(cd), 0)
    first = (chunks(prep.rank, 1) == 0) & (slot >= 0)
    bs, rs = chunks(beta.to(cd), 0), chunks(res.to(cd), 0)
    sbs = chunks(solve_beta.to(cd), 0)
    dl, do = chunks(delta.to(cd), 0), chunks(dout, 0)
    snaps = chunks(rows, 0)
    N = bs.shape[0] // P if P else 0
    Xs, QXs = X.to(cd).reshape(P, N, C, C), QX.to(cd).reshape(P, N, C, C)
    As = A.to(cd).reshape(P, N, C, C)
    below = torch.ones(C, C, dtype=torch.bool, device=v.device).tril(-1)
    parts = {k: [None] * N for k in ("dv", "dbeta", "dgw", "dgr", "dsw", "drd", "dA", "dQK")}
    for n in reversed(range(N)):
        c = torch.arange(P, device=v.device) * N + n
        sl, rsl, fr = slot[c], rslot[c], first[c]
        flat = sl.reshape(P, -1)
        W = sl.shape[-1]
        wrows, rrows = snaps[c][:, :, :W], snaps[c][:, :, W:]
        dm1 = _gather_rows(dM, flat).reshape(P, C, -1, D)
        ddelta = (sw[c][..., None] * dm1).sum(2)
        parts["dsw"][n] = (dm1 * dl[c][:, :, None, :]).sum(-1)
        parts["drd"][n] = torch.where(fr, (dm1 * wrows).sum(-1), 0)
        du = Xs[:, n].transpose(1, 2) @ ddelta + QXs[:, n].transpose(1, 2) @ do[c]
        dL = torch.where(below, -(du @ dl[c].transpose(1, 2)), 0)
        parts["dA"][n] = dL * sbs[c][..., None]
        parts["dQK"][n] = torch.tril(do[c] @ dl[c].transpose(1, 2))
        parts["dv"][n] = bs[c][..., None] * du
        a_n = As[:, n]
        parts["dbeta"][n] = (du * rs[c]).sum(-1) + torch.where(a_n != 0, dL * a_n, 0).sum(-1)
        dret = -bs[c][..., None] * du
        parts["dgw"][n] = (dret[:, :, None, :] * wrows).sum(-1)
        parts["dgr"][n] = (do[c][:, :, None, :] * rrows).sum(-1)
        add = (
            torch.where(fr[..., None], (rd[c][..., None] - 1) * dm1, 0)
            + gw[c][..., None] * dret[:, :, None, :]
        )
        add = torch.where((flat >= 0)[..., None], add.reshape(P, -1, D), 0)
        dM = dM.scatter_add(1, flat.clamp(min=0)[..., None].expand(*flat.shape, D), add)
        rflat = rsl.reshape(P, -1)
        radd = (gr[c][..., None] * do[c][:, :, None, :]).reshape(P, -1, D)
        radd = torch.where((rflat >= 0)[..., None], radd, 0)
        dM = dM.scatter_add(1, rflat.clamp(min=0)[..., None].expand(*rflat.shape, D), radd)

    def tokens(name, *shape):
        if N == 0:
            return v.new_zeros(B, T, H, *shape, dtype=cd)
        x = torch.stack(parts[name], 1).reshape(P * N, C, *shape)
        return from_streams(_unchunked(x, P, T), B, H)

    W, R = write_idx.shape[-1], read_idx.shape[-1]
    chunk = lambda name: (
        torch.stack(parts[name], 1).reshape(B, H, N, C, C)
        if N
        else v.new_zeros(B, H, 0, C, C, dtype=cd)
    )
    return (
        tokens("dv", D),
        tokens("dbeta"),
        tokens("dgw", W),
        tokens("dgr", R),
        tokens("dsw", W),
        tokens("drd", W),
        chunk("dA"),
        chunk("dQK"),
        dM.reshape(B, H, S, D),
    )


def _chunk_weights_backward(
    write_idx, write_w, read_idx, read_w, decay, s: int, dA, dQK, dgw, dgr, dsw, drd
):
    """Explicit backward of :func:`chunk_weights` (inputs [P, C, W] / [P, C, R], dA and dQK
    [P, C, C]); the same algorithm as the phase-1 backward kernel: every decay product that
    contains a token's decay is split into the product before it and the product after it."""
    P, C, W = write_idx.shape
    R = read_idx.shape[-1]
    cd = write_w.dtype
    ce = _chunk_entries(write_idx, write_w, read_idx, read_w, decay, s)
    s_b, w_b, d_b, s_r, w_r, ok_b, ok_r, same, rsame, _, _ = ce
    E, Er = C * W, C * R
    dev = s_b.device
    tok = torch.arange(C, device=dev)
    te, ti = tok.repeat_interleave(W), tok.repeat_interleave(R)
    wsame = (s_b[:, :, None] == s_r[:, None, :]) & ok_b[:, :, None] & ok_r[:, None, :]  # [P, E, Er]
    one = torch.ones((), dtype=cd, device=dev)

    def per_token(match, vals, n):  # [P, X, C * n] -> sum over a token's entries: [P, X, C]
        return torch.where(match, vals[:, None, :], 0).reshape(*match.shape[:2], C, n).sum(-1)

    dec_on = torch.where(same, d_b[:, None, :], one).reshape(P, E, C, W).prod(-1)  # [P, E, C]
    K = per_token(same, w_b, W)
    Q = per_token(wsame, w_r, R)
    Gs = per_token(same, dgw.reshape(P, E) * w_b, W) + per_token(wsame, dgr.reshape(P, Er) * w_r, R)
    Gsw = per_token(same, dsw.reshape(P, E) * w_b, W)
    Rd = per_token(same, drd.reshape(P, E), W).sum(-1)
    t_ = tok[None, None, :]
    te_ = te[None, :, None]
    fwd = torch.cumprod(torch.where(t_ > te_, dec_on, one), -1)  # (te, t]
    ub = torch.where(t_ < te_, dec_on, one).prod(-1)
    incl = torch.flip(torch.cumprod(torch.flip(torch.where(t_ < te_, dec_on, one), [-1]), -1), [-1])
    back = torch.cat([incl[..., 1:], torch.ones_like(incl[..., :1])], -1)  # (j, te-1]
    d_self = dec_on.gather(2, te.expand(P, E)[..., None]).squeeze(-1)
    me = torch.arange(E, device=dev)
    at_te = (te[None, :, None] == te[None, None, :]) & (me[None, :, None] != me[None, None, :])
    others = torch.where(same & at_te, d_b[:, None, :], one).prod(-1)
    dA_col = dA.transpose(1, 2)[:, te, :]  # [P, E, C]: dA[t, te] over t
    dQK_col = dQK.transpose(1, 2)[:, te, :]
    dA_row = dA[:, te, :]  # [P, E, C]: dA[te, j] over j
    after, from_te, before = t_ > te_, t_ >= te_, t_ < te_
    fwd_end = fwd[..., C - 1]
    dw = (
        torch.where(after, dA_col * fwd * K, 0).sum(-1)
        + torch.where(from_te, dQK_col * fwd * Q, 0).sum(-1)
        + dgw.reshape(P, E) * ub * d_self
        + dsw.reshape(P, E) * fwd_end
        + d_self * torch.where(before, dA_row * K * back, 0).sum(-1)
    )
    fwdK = torch.where(from_te, fwd * K, 0)
    fwdQ = torch.where(from_te, fwd * Q, 0)
    Z = fwdK @ dA + fwdQ @ dQK  # [P, E, C]
    dd = (
        torch.where(before, Z * K * back, 0).sum(-1)
        + fwd_end * torch.where(before, back * Gsw, 0).sum(-1)
        + ub * (torch.where(from_te, fwd * Gs, 0).sum(-1) + fwd_end * Rd)
    )
    d_decay = torch.where(ok_b, dd * others, 0)
    dw = torch.where(ok_b, dw, 0)
    # Read entries.
    rdec = torch.where(rsame, d_b[:, None, :], one).reshape(P, Er, C, W).prod(-1)  # [P, Er, C]
    Kr = per_token(rsame, w_b, W)
    ti_ = ti[None, :, None]
    upto_r = t_ <= ti_
    rincl = torch.flip(torch.cumprod(torch.flip(torch.where(upto_r, rdec, one), [-1]), -1), [-1])
    rback = torch.cat([rincl[..., 1:], torch.ones_like(rincl[..., :1])], -1)  # (j, i]
    rupto = torch.where(upto_r, rdec, one).prod(-1)
    dQK_row = dQK[:, ti, :]
    drw = torch.where(upto_r, dQK_row * Kr * rback, 0).sum(-1) + dgr.reshape(P, Er) * rupto
    drw = torch.where(ok_r, drw, 0)
    return dw.reshape(P, C, W), drw.reshape(P, C, R), d_decay.reshape(P, C, W)


def chunk_prepare_backward_reference(
    write_idx,
    write_w,
    read_idx,
    read_w,
    decay,
    bank_rows: int,
    dA,
    dQK,
    d_gather_w,
    d_gather_r,
    d_scatter_w,
    d_row_decay,
    *,
    slab: int = 256,
):
    """Backward of :func:`chunk_prepare_reference`: (d_write_w, d_read_w, d_decay or None)."""
    cd = compute_dtype(write_w, read_w, decay)
    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    P, C = B * H, dA.shape[-1]

    def ch(x, fill):
        return _chunked(to_streams(x), C, fill)

    wi, ri = ch(write_idx, -1), ch(read_idx, -1)
    ww, rw = ch(write_w.to(cd), 0), ch(read_w.to(cd), 0)
    dc = None if decay is None else ch(decay.to(cd), 1)
    gw, gr, sw, rd = (ch(x.to(cd), 0) for x in (d_gather_w, d_gather_r, d_scatter_w, d_row_decay))
    a, q = dA.to(cd).reshape(-1, C, C), dQK.to(cd).reshape(-1, C, C)
    parts = [
        _chunk_weights_backward(
            wi[i : i + slab],
            ww[i : i + slab],
            ri[i : i + slab],
            rw[i : i + slab],
            None if dc is None else dc[i : i + slab],
            bank_rows,
            a[i : i + slab],
            q[i : i + slab],
            gw[i : i + slab],
            gr[i : i + slab],
            sw[i : i + slab],
            rd[i : i + slab],
        )
        for i in range(0, wi.shape[0], slab)
    ]
    if not parts:
        z = write_w.new_zeros(B, T, H, W, dtype=cd)
        return z, read_w.new_zeros(B, T, H, R, dtype=cd), (None if decay is None else z.clone())
    dww, drw, ddc = (torch.cat(f, 0) for f in zip(*parts))

    def entries(x):
        return from_streams(_unchunked(x, P, T), B, H)

    return entries(dww), entries(drw), (None if decay is None else entries(ddc))
