"""The tests' oracle of the recurrence: the definition run token by token in float64 on dense
per-stream state, written apart from ``sdm_ops`` (it imports nothing from the package), with
every gradient from float64 autograd through the token loop.

Per stream the bank M is [S, D]; token t builds its dense key k_t, query q_t and decay d_t
over the S slots from its entries (padding, or any index outside [0, S), matches no slot;
entries on one slot add their weights and multiply their decays), then

    M' = diag(d_t) M;   M = M' + beta_t k_t (v_t - M'^T k_t)^T;   out_t = M^T q_t.

The sums run over the slots the token's entries name, and only those rows change: a slot
no entry names contributes nothing and is not written, whatever the token's values and the
other rows hold (selected away, never multiplied by zero), so that a non-finite value goes
only where the definition sends it: padding is inert, a NaN bank row reaches only the tokens
that read or write it, and read weights never reach the bank.

A shared bank [H, S, D] is expanded over the batch (autograd sums its gradient); a packed
batch (``cu_seqlens``) runs each sequence alone from its own bank or the shared one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

FLOATS = ("v", "beta", "write_w", "read_w", "bank", "decay")
F64 = torch.float64


class OracleRun(NamedTuple):
    out: Tensor  # [B, T, H, D] float64
    bank: Tensor  # the final state [B, H, S, D] ([N, H, S, D] packed), float64
    states: dict  # t -> the state before token t, [B, H, S, D] (dense batches, ``marks``)
    updates: Tensor  # [B, T, H, D]: each token's beta_t (v_t - M'^T k_t), what it writes


def _dense(idx: Tensor, w: Tensor, S: int, dec: Tensor | None = None):
    """[B, H, E] entries -> (key [B, H, S], decay [B, H, S] or None, named [B, H, S]): weights
    summed, decays multiplied over the entries that hit each slot, and which slots an entry
    names."""
    hit = idx[..., None] == torch.arange(S)  # [B, H, E, S]; -1 and >= S hit nothing
    key = torch.where(hit, w[..., None], 0.0).sum(-2)
    d = None if dec is None else torch.where(hit, dec[..., None], 1.0).prod(-2)
    return key, d, hit.any(-2)


def _dot(x: Tensor, named: Tensor, M: Tensor) -> Tensor:
    """x^T M over the ``named`` slots only: [B, H, S] and [B, H, S, D] -> [B, H, D]."""
    return torch.where(named[..., None], x[..., None] * M, 0.0).sum(-2)


def _walk(v, beta, write_idx, write_w, read_idx, read_w, M, decay, add=None, marks=()):
    """The recurrence over [B, T, H, ...] from M [B, H, S, D]. ``add`` (t -> [B, H, S, D]) is
    added to the state before token t; ``marks``: the tokens before which the state is kept."""
    T, S = v.shape[1], M.shape[-2]
    outs, ups, states = [], [], {}
    for t in range(T):
        if add is not None and t in add:
            M = M + add[t]
        if t in marks:
            states[t] = M
        dec = None if decay is None else decay[:, t]
        k, d, written = _dense(write_idx[:, t], write_w[:, t], S, dec)
        q, _, read = _dense(read_idx[:, t], read_w[:, t], S)
        Mp = M if d is None else torch.where(written[..., None], d[..., None] * M, M)
        err = v[:, t] - _dot(k, written, Mp)
        up = beta[:, t, :, None] * err
        M = torch.where(written[..., None], Mp + k[..., None] * up[..., None, :], Mp)
        # A token that writes nothing writes no update (its value and beta go nowhere).
        ups.append(torch.where(written.any(-1)[..., None], up, 0.0))
        outs.append(_dot(q, read, M))
    if add is not None and T in add:
        M = M + add[T]
    B, _, H, D = v.shape
    out = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, D)
    return out, M, states, torch.stack(ups, 1) if ups else out


def float64_args(args: dict) -> dict:
    """``args`` with every floating tensor as a float64 CPU tensor (bfloat16 values are
    represented exactly) and the others on the CPU."""
    return {
        k: (x.detach().cpu().to(F64) if x.is_floating_point() else x.cpu())
        if torch.is_tensor(x)
        else x
        for k, x in args.items()
    }


def sdm_oracle(args: dict, *, add=None, marks=()) -> OracleRun:
    """The recurrence of ``args`` (``sparse_delta_memory``'s arguments by name, float64 CPU
    tensors; ``cu_seqlens`` optional). ``add`` and ``marks`` (dense batches only): see
    :func:`_walk`; ``add[T]`` is added to the final state."""
    a = dict(args)
    bank, cu = a.pop("bank"), a.pop("cu_seqlens", None)
    decay = a.get("decay")
    names = ("v", "beta", "write_idx", "write_w", "read_idx", "read_w")
    B = a["v"].shape[0]
    if cu is None:
        M = bank.expand(B, *bank.shape[-3:])
        return OracleRun(*_walk(*(a[k] for k in names), M, decay, add, marks))
    assert add is None and not marks, "add and marks need a dense batch"
    offsets = cu.tolist()
    outs, finals, ups = [], [], []
    for n in range(len(offsets) - 1):
        t = slice(offsets[n], offsets[n + 1])
        M = (bank if bank.dim() == 3 else bank[n])[None]
        seq = [a[k][:, t] for k in names]
        out, final, _, up = _walk(*seq, M, None if decay is None else decay[:, t])
        outs.append(out)
        finals.append(final)
        ups.append(up)
    return OracleRun(torch.cat(outs, 1), torch.cat(finals, 0), {}, torch.cat(ups, 1))


def oracle_with_grads(
    args: dict, g_out: Tensor, g_bank: Tensor | None, *, add=None, marks=(), state_grads=()
):
    """``(run, grads, dstates)`` for the loss sum(out * g_out) + sum(bank * g_bank) (the bank
    term only with ``g_bank``), in float64: ``grads`` by name for every floating argument, and
    ``dstates[t]`` the gradient of the state before token t (T: the final state) for t in
    ``state_grads`` (dense batches). ``add`` and ``marks`` go to :func:`sdm_oracle`."""
    a = float64_args(args)
    leaves = {k: a[k].requires_grad_() for k in FLOATS if a.get(k) is not None}
    probes = {
        t: torch.zeros_like(a["bank"].expand(a["v"].shape[0], *a["bank"].shape[-3:]))
        for t in state_grads
    }
    for p in probes.values():
        p.requires_grad_()
    shifts = dict(add or {})
    for t, p in probes.items():
        shifts[t] = p if t not in shifts else shifts[t] + p
    run = sdm_oracle(a, add=shifts or None, marks=marks)
    loss = (run.out * g_out.detach().cpu().to(F64)).sum()
    if g_bank is not None:
        loss = loss + (run.bank * g_bank.detach().cpu().to(F64)).sum()
    wrt = list(leaves.values()) + list(probes.values())
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads)]
    run = OracleRun(
        run.out.detach(),
        run.bank.detach(),
        {t: m.detach() for t, m in run.states.items()},
        run.updates.detach(),
    )
    return run, dict(zip(leaves, grads)), dict(zip(probes, grads[len(leaves) :]))


def _take(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, H, S] at idx [B, H, E] (0 where idx is outside [0, S))."""
    ok = (idx >= 0) & (idx < x.shape[-1])
    return torch.where(ok, torch.gather(x, -1, idx.clamp(0, x.shape[-1] - 1)), 0.0)


def chunk_entry_terms(args: dict, chunk_size: int) -> dict:
    """What chunk n of a dense batch applies to its entries' slots, in float64 from the
    float64 arguments ``args`` (differentiable in the weights and decays): for a write entry
    b of token j on slot s, ``gather_w`` = w_b times the decays of s from the chunk's start
    through token j, ``scatter_w`` = w_b times those after token j to the chunk's end,
    ``row_decay`` = all the chunk's decays of s, and ``count`` the write entries of the chunk
    on s; ``gather_r`` the same as ``gather_w`` for a read entry (the decays through its
    token). Shapes [B, T, H, W] or [B, T, H, R]."""
    wi, ww, ri, rw = (args[k] for k in ("write_idx", "write_w", "read_idx", "read_w"))
    decay = args.get("decay")
    B, T, H, W = wi.shape
    S = args["bank"].shape[-2]
    cols = {k: [None] * T for k in ("gather_w", "scatter_w", "row_decay", "count", "gather_r")}
    for c0 in range(0, T, chunk_size):
        toks = range(c0, min(c0 + chunk_size, T))
        dec = {}
        total = torch.zeros(B, H, S, dtype=F64)
        for j in toks:
            key, d, _ = _dense(
                wi[:, j], torch.ones_like(ww[:, j]), S, None if decay is None else decay[:, j]
            )
            dec[j] = torch.ones(B, H, S, dtype=F64) if d is None else d
            total = total + key
        upto = torch.ones(B, H, S, dtype=F64)
        for j in toks:
            upto = upto * dec[j]
            cols["gather_w"][j] = ww[:, j] * _take(upto, wi[:, j])
            cols["gather_r"][j] = rw[:, j] * _take(upto, ri[:, j])
        after = torch.ones(B, H, S, dtype=F64)
        for j in reversed(toks):
            cols["scatter_w"][j] = ww[:, j] * _take(after, wi[:, j])
            after = after * dec[j]
        for j in toks:
            cols["row_decay"][j] = _take(after, wi[:, j])
            cols["count"][j] = _take(total, wi[:, j])
    return {k: torch.stack(v, 1) if T else None for k, v in cols.items()}


# ---------------------------------------------------------------------------
# Snapshots: the documented storage and its error bound per mode
# ---------------------------------------------------------------------------

GROUP = 16  # the documented quantization group: one fp8 or int4 scale per 16 columns


def _e4m3(bits: Tensor) -> Tensor:
    """float8_e4m3fn bit patterns (uint8) -> float64 values."""
    b = bits.to(torch.int64)
    sign = torch.where(b & 0x80 > 0, -1.0, 1.0).to(F64)
    exp, man = (b >> 3) & 15, (b & 7).to(F64)
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).to(F64))
    return sign * torch.where(exp == 0, man * 2.0**-9, normal)


def dequantize_snapshot(snap: Tensor, scale: Tensor, mode: str, D: int) -> Tensor:
    """The documented snapshot storage read back in float64: ``none``/``bf16`` rows as they
    are; ``fp8`` e4m3 codes and ``int4`` codes + 8, two a byte (the even column in the low
    nibble), each times its group's scale ``[..., D / 16]``."""
    snap, scale = snap.cpu(), scale.cpu()
    if mode in ("none", "bf16"):
        return snap.to(F64)
    if mode == "fp8":
        x = _e4m3(snap)
    else:
        lo, hi = (snap & 15).to(F64) - 8, (snap >> 4).to(F64) - 8
        x = torch.stack((lo, hi), -1).reshape(*snap.shape[:-1], D)
    groups = x.reshape(*x.shape[:-1], D // GROUP, GROUP) * scale.to(F64)[..., None]
    return groups.reshape(x.shape)


def snapshot_error_bound(rows: Tensor, mode: str, bf16_unit: float) -> Tensor:
    """The largest error of each element of ``rows`` [..., D] stored in ``mode``, from the
    documented storage, with g the largest magnitude of the element's group of 16 columns:

    - ``bf16``: one rounding to bfloat16, ``bf16_unit |x|`` (2^-8 rounding to nearest;
      Triton's interpreter truncates: 2^-7);
    - ``fp8``: x / s with s = g / 448 rounded to e4m3 (3 mantissa bits, to nearest): 2^-4 of
      the value in the normal range, half the subnormal spacing 2^-9 below it, so
      ``2^-4 |x| + 2^-10 s``;
    - ``int4``: x / s with s = g / 7 rounded to an integer: half a step, ``g / 14``;
    - ``none``: 0.
    """
    D = rows.shape[-1]
    x = rows.reshape(*rows.shape[:-1], D // GROUP, GROUP)
    g = x.abs().amax(-1, keepdim=True)
    if mode == "none":
        b = torch.zeros_like(x)
    elif mode == "bf16":
        b = bf16_unit * x.abs()
    elif mode == "fp8":
        b = 2.0**-4 * x.abs() + 2.0**-10 * g / 448
    else:
        b = (g / 14).expand_as(x)
    return b.reshape(rows.shape)


def rows_at(states: dict, idx: Tensor, chunk_size: int, D: int) -> Tensor:
    """[B, T, H, E, D]: for each entry (idx [B, T, H, E]), the row of its slot in the state at
    the start of its chunk (``states[c0]`` [B, H, S, D], c0 = 0, C, 2C, ...); zero for
    padding."""
    B, T, H, E = idx.shape
    out = torch.zeros(B, T, H, E, D, dtype=F64)
    for c0 in range(0, T, chunk_size):
        M = states[c0]
        S = M.shape[-2]
        i = idx[:, c0 : c0 + chunk_size].transpose(1, 2)  # [B, H, c, E]
        flat = i.clamp(0, S - 1).reshape(B, H, -1, 1).expand(-1, -1, -1, D)
        got = torch.gather(M, 2, flat).reshape(*i.shape, D)
        ok = ((i >= 0) & (i < S))[..., None]
        out[:, c0 : c0 + chunk_size] = torch.where(ok, got, 0.0).transpose(1, 2)
    return out


def snapshot_gradient_bounds(
    args: dict, g_out: Tensor, g_bank: Tensor | None, chunk_size: int, mode: str, bf16_unit
):
    """``(run, grads, rows, bounds)``: the oracle's run and gradients (as
    :func:`oracle_with_grads`), the exact chunk-start rows of every entry [B, T, H, W + R, D]
    and, for ``write_w``, ``read_w`` and ``decay``, the largest error in each element of their
    gradients that snapshot rows within :func:`snapshot_error_bound` can cause (dense
    batches).

    The backward uses the snapshot rows M[s] (the chunk-start row of an entry's slot) in three
    dot products only: d gather_w[a] = -dv_i . M[s_a] (dv = beta du and the gradient of
    the retrieved row is -beta du), d gather_r[r] = dout_i . M[s_r] and d row_decay[b] =
    dM[s_b] . M[s_b], dM the gradient of the state at the end of the chunk; dv, dout and dM
    are exact whatever the snapshot. An error e in the rows moves those by at most
    sum_d |dv_i[d]| e[d] (and so on), and they reach the weights and decays through the
    chunk's gather, scatter and decay products (:func:`chunk_entry_terms`), polynomials whose
    terms are the weights times decays in [0, 1]: their Jacobian at |w| bounds theirs at w
    element by element, so its transpose applied to those bounds bounds the gradients'
    errors, element by element, to first order (and the rows enter linearly: there is no
    second order)."""
    T = args["v"].shape[1]
    starts = list(range(0, T, chunk_size))
    ends = starts[1:] + [T]
    run, want, dstate = oracle_with_grads(
        args, g_out, g_bank, marks=starts, state_grads=[*starts[1:], T]
    )
    a = float64_args(args)
    W, D = a["write_idx"].shape[-1], a["v"].shape[-1]
    idx = torch.cat([a["write_idx"], a["read_idx"]], -1)
    rows = rows_at(run.states, idx, chunk_size, D)
    if T == 0:
        zero = {k: torch.zeros_like(a[k]) for k in ("write_w", "read_w", "decay") if k in a}
        return run, want, rows, zero
    e = snapshot_error_bound(rows, mode, bf16_unit)
    dM = rows_at(dict(zip(starts, (dstate[t] for t in ends))), a["write_idx"], chunk_size, D)
    b_gw = (want["v"].abs()[..., None, :] * e[..., :W, :]).sum(-1)
    b_gr = (g_out.detach().cpu().to(F64).abs()[..., None, :] * e[..., W:, :]).sum(-1)
    b_rd = (dM.abs() * e[..., :W, :]).sum(-1)
    leaves = {"write_w": a["write_w"].abs(), "read_w": a["read_w"].abs()}
    if a.get("decay") is not None:
        leaves["decay"] = a["decay"]
    leaves = {k: x.clone().requires_grad_() for k, x in leaves.items()}
    terms = chunk_entry_terms(dict(a, **leaves), chunk_size)
    total = (
        (terms["gather_w"] * b_gw).sum()
        + (terms["gather_r"] * b_gr).sum()
        + (terms["row_decay"] * b_rd).sum()
    )
    bounds = dict(zip(leaves, torch.autograd.grad(total, list(leaves.values()))))
    return run, want, rows, bounds
