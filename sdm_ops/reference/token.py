"""The token-by-token recurrence on dense per-stream state (the oracle of every chunked path)
and one decode step."""

from __future__ import annotations

import torch

from ._common import _entries, _gather_rows, compute_dtype


def _dense(slot, w, dec, S: int):
    """A token's entries (``slot``, ``w``, ``dec`` [B, H, E], slot -1 for padding) as dense
    [B, H, S] vectors: the sum of their weights on each slot, the product of their decays (1
    without), and which slots they name."""
    B, H, _ = slot.shape
    k = torch.zeros(B, H, S, dtype=w.dtype)
    d = torch.ones(B, H, S, dtype=w.dtype)
    named = torch.zeros(B, H, S, dtype=torch.bool)
    for j in range(slot.shape[-1]):
        hit = torch.nn.functional.one_hot(slot[..., j].clamp(min=0), S).to(torch.bool)
        hit &= (slot[..., j] >= 0)[..., None]
        named |= hit
        k = k + torch.where(hit, w[..., j : j + 1], 0)
        if dec is not None:
            d = d * torch.where(hit, dec[..., j : j + 1], 1)
    return k, d, named


def sdm_token_reference(v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None):
    """The recurrence token by token on dense per-stream state (small S only).

    Returns (out [B, T, H, D], bank [B, H, S, D]) in the compute dtype.
    """
    cd = compute_dtype(v, bank, write_w, read_w, beta, decay)
    B, T, H, D = v.shape
    S = bank.shape[-2]
    M = bank.to(cd).expand(B, H, S, D).clone()
    outs = []
    for t in range(T):
        slot, w, dec = _entries(
            write_idx[:, t], write_w[:, t].to(cd), S, None if decay is None else decay[:, t].to(cd)
        )
        rslot, rw, _ = _entries(read_idx[:, t], read_w[:, t].to(cd), S)
        k, d, written = _dense(slot, w, dec, S)
        q, _, read = _dense(rslot, rw, None, S)
        # Sums over the named slots only, and only written rows change (selected, not
        # multiplied by zero: padding and rows no entry names stay out of every sum).
        Mp = torch.where(written[..., None], d[..., None] * M, M)
        err = v[:, t].to(cd) - torch.where(written[..., None], k[..., None] * Mp, 0).sum(-2)
        up = beta[:, t].to(cd)[..., None, None] * k[..., None] * err[..., None, :]
        M = torch.where(written[..., None], Mp + up, Mp)
        outs.append(torch.where(read[..., None], q[..., None] * M, 0).sum(-2))
    out = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, D, dtype=cd)
    return out, M


def decode_step_reference(bank, v, beta, write_idx, write_w, read_idx, read_w, decay=None):
    """One token (T = 1) of the recurrence on every stream, touching only the rows the token
    addresses (any S): d[s] is the product of the token's decays on slot s and K[s] the sum
    of its write weights there, so M[s] <- d[s] M[s] + K[s] u with u = beta (v - sum_a w_a
    d[s_a] M[s_a]), and out reads the written rows as d M + K u.

    bank [B, H, S, D]; v [B, 1, H, D]; the rest as in :func:`sdm_token_reference` with T = 1.
    Returns (out [B, 1, H, D], new [B, H, W, D], slot [B, H, W]) in the compute dtype: the
    new row of each write entry's slot (entries on one slot get the same row) and the slots
    (-1 for padding), for the caller to store.
    """
    cd = compute_dtype(v, bank, write_w, read_w, beta, decay)
    B, _, H, D = v.shape
    S = bank.shape[-2]
    slot, w, dec = _entries(
        write_idx[:, 0], write_w[:, 0].to(cd), S, None if decay is None else decay[:, 0].to(cd)
    )  # [B, H, W]
    rslot, rw, _ = _entries(read_idx[:, 0], read_w[:, 0].to(cd), S)  # [B, H, R]
    if dec is None:
        dec = torch.ones_like(w)

    def on_slot(x, y):  # [..., X, W]: entry of x and write entry of y on one slot
        return (x[..., :, None] == y[..., None, :]) & (x[..., :, None] >= 0)

    same, hit = on_slot(slot, slot), on_slot(rslot, slot)
    d = torch.where(same, dec[..., None, :], 1).prod(-1)
    K = torch.where(same, w[..., None, :], 0).sum(-1)
    d_r = torch.where(hit, dec[..., None, :], 1).prod(-1)
    K_r = torch.where(hit, w[..., None, :], 0).sum(-1)
    M = bank.to(cd).reshape(B * H, S, D)
    rows = _gather_rows(M, slot.reshape(B * H, -1)).reshape(B, H, -1, D)
    qrows = _gather_rows(M, rslot.reshape(B * H, -1)).reshape(B, H, -1, D)
    u = beta[:, 0].to(cd)[..., None] * (v[:, 0].to(cd) - ((w * d)[..., None] * rows).sum(-2))
    # u reaches the slots the token writes only (selected: the token may hold any value where
    # it writes nothing, and 0 x NaN is NaN).
    after = d_r[..., None] * qrows + torch.where(
        hit.any(-1)[..., None], K_r[..., None] * u[..., None, :], 0
    )
    out = torch.where((rslot >= 0)[..., None], rw[..., None] * after, 0).sum(-2)
    new = d[..., None] * rows + K[..., None] * u[..., None, :]
    return out[:, None], new, slot
