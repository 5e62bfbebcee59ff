"""Helpers shared by the reference modules: compute dtype, stream layout, entry masks."""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any floating input is float64, else float32 (internal arithmetic)."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


def to_streams(x: Tensor) -> Tensor:
    """[B, T, H, ...] -> [B * H, T, ...]."""
    b, t, h = x.shape[:3]
    return x.transpose(1, 2).reshape(b * h, t, *x.shape[3:])


def from_streams(x: Tensor, b: int, h: int) -> Tensor:
    """[B * H, T, ...] -> [B, T, H, ...]."""
    return x.reshape(b, h, *x.shape[1:]).transpose(1, 2)


def _entries(idx: Tensor, w: Tensor, s: int, decay: Tensor | None = None):
    """Slots (padding -> -1), masked weights and masked decays of entries."""
    valid = (idx >= 0) & (idx < s)
    slot = torch.where(valid, idx.to(torch.int64), -1)
    w = torch.where(valid, w, torch.zeros_like(w))
    if decay is not None:
        decay = torch.where(valid, decay, torch.ones_like(decay))
    return slot, w, decay


def _gather_rows(M: Tensor, slot: Tensor) -> Tensor:
    """Rows M[p, slot] ([P, S, D], slot [P, N]) -> [P, N, D], zero for padding."""
    rows = torch.gather(M, 1, slot.clamp(min=0)[..., None].expand(*slot.shape, M.shape[-1]))
    zero = torch.zeros((), dtype=M.dtype, device=M.device)
    return torch.where((slot >= 0)[..., None], rows, zero)


def _chunked(x: Tensor, c: int, fill) -> Tensor:
    """[P, T, ...] -> [P * N, C, ...], padding the last chunk with ``fill``."""
    p, t = x.shape[:2]
    n = -(-t // c)
    pad = n * c - t
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad), value=fill)
    return x.reshape(p * n, c, *x.shape[2:])


def _unchunked(x: Tensor, p: int, t: int) -> Tensor:
    """[P * N, C, ...] -> [P, T, ...]."""
    n = x.shape[0] // p if p else 0
    return x.reshape(p, n * x.shape[1], *x.shape[2:])[:, :t]


def first_bad(x: Tensor, exists: Tensor) -> Tensor:
    """Per chunk, the first token whose row of ``x`` [P, C, D] holds a value that is not
    finite, among ``exists`` [P, C] (C where none does): [P]."""
    C = x.shape[1]
    bad = exists & ~torch.isfinite(x).all(-1)
    i = torch.arange(C, device=x.device)
    return torch.where(bad, i, C).amin(-1) if C else torch.zeros_like(bad[:, 0], dtype=i.dtype)


def before(first: Tensor, C: int) -> Tensor:
    """[P, C, 1]: the tokens of each chunk before ``first`` [P]."""
    return (torch.arange(C, device=first.device) < first[:, None])[..., None]
