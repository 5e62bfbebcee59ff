"""Padding and non-finite values under the chunked form.

The definition changes only the rows a token's entries name and reads only those rows, so a
padding entry (index outside [0, S)) is inert whatever its weight and decay hold, a token
with no valid write entry writes nothing whatever its value and beta hold, and a non-finite
value reaches only later tokens of its stream. The chunked form mixes a chunk's tokens in dot
products (phase 1's pair terms, the WY solve, X u and QX u), where a masked term multiplied by
zero would still carry a NaN (0 x NaN is NaN) to every token of the chunk. So:

- phase 1 and the WY solve run on finite inputs: ``clean`` selects weights of invalid or
  non-finite entries to 0, their decays to 1, and beta to 0 where the token writes nothing or
  beta is not finite;
- what was not finite is put back where the chunk's later tokens see it: ``beta_walk`` is NaN
  for a token whose write side (a valid entry's weight or decay, or its beta) is not finite,
  and ``poison_reads`` makes the gather weights of a token whose read weights are not finite
  NaN. Phase 2 then finds, per chunk, the first token whose update u = beta (v - retrieved)
  or whose read (inter) is not finite, runs the chunk's products on the tokens before it,
  and makes every later token's update and output of the chunk NaN (every column the
  program owns): a non-finite write reaches the rows the chunk's later tokens write, a
  non-finite read the later outputs only, and neither an earlier token nor the bank through
  a read.

``select`` gives both in one call; on a GPU it is one kernel (``kernels/finite_select.py``).

Over-approximating within a chunk is what the contract allows (a non-finite value may reach
everything after it in its stream); what it never does is reach an earlier token, another
stream, or the bank through a read weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

FLT_MAX = 3.4028234663852886e38  # |x| <= FLT_MAX: finite (NaN compares false)


class Clean(NamedTuple):
    """Finite inputs for phase 1 and the WY solve, and what phase 2 needs to put the
    non-finite values back (see the module docstring)."""

    beta: Tensor  # [B, T, H]: 0 where the token writes nothing or beta is not finite
    beta_walk: Tensor  # beta, NaN where the token's write side is not finite
    write_w: Tensor  # [B, T, H, W]: 0 for invalid or non-finite entries
    read_w: Tensor  # [B, T, H, R]: likewise
    decay: Tensor | None  # [B, T, H, W]: 1 for invalid or non-finite entries
    bad_reads: Tensor | None  # [B, T, H, R] bool: the valid read entries of a token whose
    # read weights are not all finite (None in the backward, which does not read it)


def _finite(x: Tensor) -> Tensor:
    # Compared in a 16-bit float's own dtype FLT_MAX rounds to inf, and inf <= inf would keep
    # an infinite bfloat16 value; every finite 16-bit value is within FLT_MAX.
    if x.dtype.itemsize < 4:
        return torch.isfinite(x)
    return x.abs() <= FLT_MAX


def clean(keep: Kept, beta: Tensor, write_w: Tensor, read_w: Tensor, decay: Tensor | None) -> Clean:
    """The finite inputs of phase 1 and the WY solve (``Clean``) of one call, from the masks of
    what it keeps (``kept``)."""
    # Each kept mask lies inside its entries' (or, for beta, ``writes``), so an exclusive or
    # gives the valid entries that were not kept: one launch a mask on a GPU.
    good_w = keep.write_w if decay is None else keep.write_w & keep.decay
    bad_w = keep.write_entries ^ good_w
    if decay is not None:
        decay = torch.where(keep.decay, decay, 1.0)
    write_bad = bad_w.any(-1) | (keep.writes ^ keep.beta)
    bad_r = keep.read_entries ^ keep.read_w
    bad_reads = keep.read_entries & bad_r.any(-1, keepdim=True)
    beta = torch.where(keep.beta, beta, 0.0)
    return Clean(
        beta=beta,
        beta_walk=torch.where(write_bad, float("nan"), beta),
        write_w=torch.where(keep.write_w, write_w, 0.0),
        read_w=torch.where(keep.read_w, read_w, 0.0),
        decay=decay,
        bad_reads=bad_reads,
    )


def poison_reads(gather_r: Tensor, bad_reads: Tensor) -> Tensor:
    """Phase 1's read gather weights with NaN on the read entries of a token whose read
    weights are not finite (``Clean.bad_reads``): phase 2's read of that token is then not
    finite, and its outputs from there on are NaN."""
    return torch.where(bad_reads, float("nan"), gather_r)


class Kept(NamedTuple):
    """Which inputs ``clean`` kept (bool masks): their gradients pass, the others' are 0
    (an input selected away does not reach the outputs the forward computed)."""

    beta: Tensor
    write_w: Tensor
    read_w: Tensor
    decay: Tensor | None
    # The write entries inside [0, S), padding or not; the same of the read entries; the
    # tokens with a write entry inside (None in the backward, which does not read them).
    write_entries: Tensor | None
    read_entries: Tensor | None
    writes: Tensor | None

    @staticmethod
    def _keep(mask: Tensor, grad: Tensor) -> Tensor:
        return torch.where(mask, grad, 0.0)

    def keep_beta(self, grad: Tensor) -> Tensor:
        return self._keep(self.beta, grad)

    def keep_write_w(self, grad: Tensor) -> Tensor:
        return self._keep(self.write_w, grad)

    def keep_read_w(self, grad: Tensor) -> Tensor:
        return self._keep(self.read_w, grad)

    def keep_decay(self, grad: Tensor) -> Tensor:
        return grad if self.decay is None else self._keep(self.decay, grad)


def kept(
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    S: int,
) -> Kept:
    """The masks of what ``clean`` keeps of these inputs."""
    valid_w = (write_idx >= 0) & (write_idx < S)
    valid_r = (read_idx >= 0) & (read_idx < S)
    writes = valid_w.any(-1)
    return Kept(
        beta=writes & _finite(beta),
        write_w=valid_w & _finite(write_w),
        read_w=valid_r & _finite(read_w),
        decay=None if decay is None else valid_w & _finite(decay),
        write_entries=valid_w,
        read_entries=valid_r,
        writes=writes,
    )


# The outputs of ``select`` (the operator ``sdm_internal::finite_select``), in this order:
# ``Clean``'s fields, then ``Kept``'s masks. Without decay, decay and kept_decay are empty.
SELECTED = (
    "beta",
    "beta_walk",
    "write_w",
    "read_w",
    "decay",
    "bad_reads",
    "kept_beta",
    "kept_write_w",
    "kept_read_w",
    "kept_decay",
)
# What the forward keeps of its selection for the backward, in this order (``SELECTED`` but
# bad_reads): the clean inputs its phase 1 and WY solve ran on, which their backwards take, and
# the masks of what was kept, which pass the gradients (``kept_selection``). The raw inputs
# are not needed again.
KEPT_FOR_BACKWARD = SELECTED[:5] + SELECTED[6:]


def select(
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    S: int,
) -> tuple[Tensor, ...]:
    """``clean``'s inputs and ``kept``'s masks of one call, in the order of ``SELECTED``: the
    reference of ``sdm_internal::finite_select`` (``kernels/finite_select.py`` is its
    kernel)."""
    keep = kept(beta, write_idx, write_w, read_idx, read_w, decay, S)
    c = clean(keep, beta, write_w, read_w, decay)
    no_decay = beta.new_empty(0), beta.new_empty(0, dtype=torch.bool)
    decays = no_decay if decay is None else (c.decay, keep.decay)
    masks = (keep.beta, keep.write_w, keep.read_w, decays[1])
    return (c.beta, c.beta_walk, c.write_w, c.read_w, decays[0], c.bad_reads, *masks)


def kept_selection(saved: list[Tensor], has_decay: bool) -> tuple[Kept, Clean]:
    """The forward's ``Kept`` masks and its ``Clean`` inputs from what it kept
    (``KEPT_FOR_BACKWARD``). Only what the backward reads is there (no entry masks, no
    ``bad_reads``)."""
    beta, beta_walk, write_w, read_w, decay, kept_beta, kept_write_w, kept_read_w, kept_decay = (
        saved
    )
    keep = Kept(
        beta=kept_beta,
        write_w=kept_write_w,
        read_w=kept_read_w,
        decay=kept_decay if has_decay else None,
        write_entries=None,
        read_entries=None,
        writes=None,
    )
    cleaned = Clean(
        beta=beta,
        beta_walk=beta_walk,
        write_w=write_w,
        read_w=read_w,
        decay=decay if has_decay else None,
        bad_reads=None,
    )
    return keep, cleaned
