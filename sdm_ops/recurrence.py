"""The SDM recurrence (docs/design.md): ``sparse_delta_memory`` and ``sparse_delta_memory_``.

Each checks its arguments and calls its operator once, ``sdm::sparse_delta_memory`` or
``sdm::sparse_delta_memory_`` (``sdm_ops.ops``: phase 1, the WY solve and phase 2 with no host
synchronization), so they compile with ``fullgraph=True`` and capture in CUDA graphs; an eager
call with nothing for the dispatcher to do (no autograd, no tracing or mode) runs the
operator's body without the dispatch (``ops.eager.call``). The
checks that read data (index ranges, cu_seqlens' values) run eagerly on the CPU and, in strict
mode (``_checks.set_strict_checks``), on a GPU, where they wait for their own results (an
event), not for the stream (``_DataChecks``); otherwise a GPU call reads no data and never
waits: bad indices act as padding and malformed offsets are made well formed
(``_well_formed_offsets``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import _transforms, ops
from ._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
    data_checks_enabled,
    data_checks_wanted,
)
from .layout import CHUNK_SIZES, HEAD_DIMS, MAX_ENTRIES, SNAPSHOT_MODES
from .ops import eager


class SDMOutput(NamedTuple):
    out: Tensor  # [B, T, H, D], v's dtype
    # The final state [B, H, S, D] ([N, H, S, D] packed) in the bank's dtype, with
    # output_final_state=True; else None.
    bank: Tensor | None


def _check_index_range(name: str, idx: Tensor, S: int) -> None:
    """Every entry of ``idx`` is -1 (padding) or in [0, S); reads data (see ``_DataChecks``)."""
    bad = (idx < -1) | (idx >= S)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must hold -1 (padding) or slots in [0, {S}), got "
            f"{int(idx[pos])} at position {list(pos)}"
        )


def _check_cu_seqlens(cu: list[int], T: int) -> None:
    """Offsets ``cu`` (cu_seqlens' values) start at 0, never decrease and end at T."""
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    for n in range(1, len(cu)):
        if cu[n] < cu[n - 1]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, got {cu[n - 1]} then {cu[n]} "
                f"at positions {n - 1}, {n}"
            )
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens must end at the number of tokens T = {T}, got {cu[-1]}")


def _head_first(v: Tensor, heads: int, other: str, rest: str) -> ValueError:
    """The error for ``v`` in a head-first ``[B, H, T, D]`` layout (fla's ``head_first``), seen
    as v.shape[1] matching ``other``'s number of heads ``heads`` where v.shape[2] does not."""
    return ValueError(
        f"v must have shape [B, T, H, D] (time before heads), got {list(v.shape)}: its "
        f"dimension 1 ({v.shape[1]}) is {other}'s number of heads H = {heads}, as in a "
        f"head-first [B, H, T, D] layout; transpose v (v.transpose(1, 2)){rest}"
    )


def _check_args(
    v,
    beta,
    write_idx,
    write_w,
    read_idx,
    read_w,
    bank,
    decay,
    chunk_size,
    snapshot,
    cu_seqlens=None,
    output_final_state=False,
    *,
    inplace: bool,
) -> None:
    """Checks every argument's type, shape, device and options; the checks that read data are
    ``_DataChecks``."""
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES)
    B, T, H, D = v.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"v's last dimension D must be one of {list(HEAD_DIMS)}, got {D}")
    check_tensor("beta", beta, ndim=3, dtypes=FLOAT_DTYPES)
    # The head-first guesses below compare T with H: only for a concrete T, since comparing a
    # symbolic one (torch.export's dynamic dimensions) would specialize it to differ from H.
    concrete_t = isinstance(T, int)
    if concrete_t and tuple(beta.shape) == (B, H, T) and H != T:
        raise _head_first(v, T, "beta", "")
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    check_tensor("write_idx", write_idx, ndim=4, dtypes=INDEX_DTYPES)
    W = write_idx.shape[-1]
    check_shape("write_idx", write_idx, (B, T, H, W), "[B, T, H, W]")
    check_tensor("write_w", write_w, ndim=4, dtypes=FLOAT_DTYPES)
    check_shape("write_w", write_w, (B, T, H, W), "[B, T, H, W]")
    check_tensor("read_idx", read_idx, ndim=4, dtypes=INDEX_DTYPES)
    R = read_idx.shape[-1]
    check_shape("read_idx", read_idx, (B, T, H, R), "[B, T, H, R]")
    check_tensor("read_w", read_w, ndim=4, dtypes=FLOAT_DTYPES)
    check_shape("read_w", read_w, (B, T, H, R), "[B, T, H, R]")
    if W > MAX_ENTRIES or R > MAX_ENTRIES:
        raise ValueError(
            f"write_idx and read_idx may hold at most {MAX_ENTRIES} entries per "
            f"token, got W = {W}, R = {R}"
        )
    if decay is not None:
        check_tensor("decay", decay, ndim=4, dtypes=FLOAT_DTYPES)
        check_shape("decay", decay, (B, T, H, W), "[B, T, H, W]")
    banks, lead = B, "B"
    if cu_seqlens is not None:
        # Every bad cu_seqlens is a ValueError, its dtype included (as fla and flash-attention
        # users expect from a malformed offsets tensor).
        if isinstance(cu_seqlens, Tensor) and cu_seqlens.dtype not in INDEX_DTYPES:
            raise ValueError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
        check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
        if B != 1:
            raise ValueError(
                f"with cu_seqlens the inputs hold one packed batch, [1, T, ...]; "
                f"got v of shape {list(v.shape)} (B = {B})"
            )
        if cu_seqlens.shape[0] < 2:
            raise ValueError(
                f"cu_seqlens must hold N + 1 >= 2 offsets, got shape {list(cu_seqlens.shape)}"
            )
        banks, lead = cu_seqlens.shape[0] - 1, "N"
    check_tensor("bank", bank, ndim=(4,) if inplace else (3, 4), dtypes=FLOAT_DTYPES)
    S = bank.shape[-2]
    if concrete_t and bank.shape[-3] == T != H and bank.shape[-1] == D:
        # Every per-token input agrees with v, so all of them are head-first: only the bank,
        # whose heads are not in time's place, shows it.
        raise _head_first(
            v, T, "the bank", f" and the other per-token inputs, or give the bank H = {H} heads"
        )
    if bank.dim() == 4:
        check_shape("bank", bank, (banks, H, S, D), f"[{lead}, H, S, D]")
    else:
        check_shape("bank", bank, (H, S, D), "[H, S, D]")
    if S < 1:
        raise ValueError("bank must hold at least one slot (S >= 1)")
    check_int("chunk_size", chunk_size, choices=CHUNK_SIZES)
    if not isinstance(output_final_state, bool):
        raise TypeError(
            f"output_final_state must be a bool, got {type(output_final_state).__name__}"
        )
    if not isinstance(snapshot, str) or snapshot not in SNAPSHOT_MODES:
        raise ValueError(f"snapshot must be one of {list(SNAPSHOT_MODES)}, got {snapshot!r}")
    check_same_device(
        {
            "v": v,
            "beta": beta,
            "write_idx": write_idx,
            "write_w": write_w,
            "read_idx": read_idx,
            "read_w": read_w,
            "bank": bank,
            "decay": decay,
            "cu_seqlens": cu_seqlens,
        }
    )


def _index_bounds(idx: Tensor) -> list[Tensor]:
    """The smallest and the largest entry of ``idx`` (int64, on its device); -1 when empty."""
    if idx.numel() == 0:
        return [idx.new_full((), -1, dtype=torch.int64)] * 2
    return [b.to(torch.int64) for b in torch.aminmax(idx)]


class _DataChecks(NamedTuple):
    """The checks that read data (the index ranges, cu_seqlens' values), eager mode only: on
    the CPU, and on a GPU in strict mode (``_checks.data_checks_wanted``).

    ``start`` reduces the indices to their smallest and largest entries and copies those and
    cu_seqlens to the host without waiting (pinned memory), recording an event after the copy;
    ``finish`` waits for that event alone, then raises, naming the offending value, if a check
    fails. ``sparse_delta_memory`` queues its operator in between, which keeps the GPU busy
    while the host waits (the stream is never drained; the kernels count bad indices as
    padding, and a rejected call returns nothing); ``sparse_delta_memory_`` finishes before its
    operator writes the bank, so a rejected call changes nothing."""

    values: Tensor  # int64 on the host: write and read bounds, cu_seqlens
    ready: torch.cuda.Event | None  # None on the CPU (values already there)
    write_idx: Tensor
    read_idx: Tensor
    S: int
    T: int
    packed: bool

    @classmethod
    def start(
        cls, write_idx: Tensor, read_idx: Tensor, S: int, cu_seqlens: Tensor | None, T: int
    ) -> _DataChecks | None:
        # Meta tensors hold no data to check: shapes only (what a meta-device model needs).
        # On a GPU the checks run in strict mode alone: reading the values makes the host wait.
        if (
            write_idx.is_meta
            or not data_checks_wanted(write_idx.device)
            or not data_checks_enabled()
        ):
            return None
        values = torch.stack(_index_bounds(write_idx) + _index_bounds(read_idx))
        if cu_seqlens is not None:
            values = torch.cat([values, cu_seqlens.to(torch.int64)])
        ready = None
        if values.is_cuda:
            # The copy runs on the current stream of the tensors' device, which need not be
            # the current device: the event goes on that same stream.
            stream = torch.cuda.current_stream(values.device)
            values = values.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return cls(values, ready, write_idx, read_idx, S, T, cu_seqlens is not None)

    def finish(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        w_lo, w_hi, r_lo, r_hi, *cu = self.values.tolist()
        if w_lo < -1 or w_hi >= self.S:
            _check_index_range("write_idx", self.write_idx, self.S)
        if r_lo < -1 or r_hi >= self.S:
            _check_index_range("read_idx", self.read_idx, self.S)
        if self.packed:
            _check_cu_seqlens(cu, self.T)


def _finish(checks: _DataChecks | None) -> None:
    if checks is not None:
        checks.finish()


def _well_formed_offsets(cu_seqlens: Tensor, T: int) -> Tensor:
    """``cu_seqlens`` made well formed on its device, without reading it on the host (what a
    call whose data checks do not run passes on): each offset clamped to [0, T] and raised to
    the largest before it, the first taken as 0 and the last as T. Valid offsets come back
    unchanged; any others still split the T tokens in order into N sequences (some of them
    empty), each token in exactly one, so every output and gradient is defined and
    deterministic (the chunk tables alone would leave tokens to no sequence or to two)."""
    # Tensor operations only: an item assignment copies a host scalar in, which waits for the
    # GPU and cannot be captured.
    at = torch.arange(cu_seqlens.shape[0], device=cu_seqlens.device)
    cu = cu_seqlens.clamp(0, T)
    cu = torch.where(at == 0, 0, torch.where(at == at.shape[0] - 1, T, cu)).to(cu_seqlens.dtype)
    return torch.cummax(cu, 0).values


def _data_checks(
    write_idx: Tensor,
    read_idx: Tensor,
    S: int,
    cu_seqlens: Tensor | None,
    T: int,
    *,
    defer: bool,
) -> tuple[_DataChecks | None, Tensor | None]:
    """Starts the checks that read data: ``(checks still to finish, the offsets to pass on)``.
    Checks on the CPU finish here; on a GPU (strict mode) they are returned to finish after
    the operator is queued when ``defer``, else they finish here too. Where they do not run,
    the offsets passed on are ``_well_formed_offsets``."""
    checks = _DataChecks.start(write_idx, read_idx, S, cu_seqlens, T)
    if checks is None:
        if cu_seqlens is not None:
            cu_seqlens = _well_formed_offsets(cu_seqlens, T)
        return None, cu_seqlens
    if not defer or checks.ready is None:  # on the CPU the values are at hand
        checks.finish()
        checks = None
    return checks, cu_seqlens


def _needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd will want gradients of any of ``tensors`` (grad mode on and one of
    them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def sparse_delta_memory(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    bank: Tensor,
    decay: Tensor | None = None,
    *,
    chunk_size: int = 64,
    snapshot: str = "none",
    cu_seqlens: Tensor | None = None,
    output_final_state: bool = False,
) -> SDMOutput:
    """Run the sparse delta memory over a sequence (functional: ``bank`` is not modified).

    Per stream (batch row b, head h) the bank M is [S, D]. Token t writes ``W`` entries
    ``(write_idx, write_w)`` forming the sparse key k_t, reads ``R`` entries ``(read_idx,
    read_w)`` forming q_t, and carries the value v_t and strength beta_t:

        M' = diag(d_t) M;   M = M' + beta_t k_t (v_t - M'^T k_t)^T;   out_t = M^T q_t

    where d_t multiplies each slot the token writes by its entries' decays (1 elsewhere).

    Args:
        v: ``[B, T, H, D]`` float32 or bfloat16, D in {16, 32, 64, 128, 256}.
        beta: ``[B, T, H]`` float32 or bfloat16.
        write_idx: ``[B, T, H, W]`` int32 or int64, -1 (padding) or a slot in [0, S); W <= 64.
            An eager call rejects any other entry on the CPU and, with strict checks on
            (:func:`sdm_ops.set_strict_checks`), on a GPU; elsewhere (a GPU by default,
            compiled code, CUDA graphs) it acts as padding.
        write_w: ``[B, T, H, W]`` float32 or bfloat16.
        read_idx, read_w: ``[B, T, H, R]``, likewise; R <= 64.
        bank: ``[B, H, S, D]``, or ``[H, S, D]`` shared by the batch; float32 or bfloat16.
        decay: optional ``[B, T, H, W]`` in [0, 1], one decay per write entry.
        chunk_size: tokens per chunk, one of 16, 32, 64, 128 (results agree to rounding).
        snapshot: how the bank rows the backward reads (each entry's row at the start of its
            chunk) are kept: "none" (exact), "bf16", "fp8", "int4". Nothing is kept when no
            input requires grad (or grad mode is off).
        cu_seqlens: optional ``[N + 1]`` int32 or int64 offsets of N sequences packed into one
            batch (starting at 0, non-decreasing, ending at T), as in flash-attention and fla;
            checked as the indices are; where unchecked, malformed offsets are clamped to
            [0, T], each raised to the largest before it, the first and last taken as 0 and T.
            The inputs are then ``[1, T, H, ...]``, sequence n is tokens
            ``cu_seqlens[n] : cu_seqlens[n + 1]``, the bank is ``[N, H, S, D]`` (or a shared
            ``[H, S, D]``), and each sequence runs from its own bank as if alone; its chunks
            never straddle two sequences. No host synchronization (it may change between calls
            of a compiled function without recompiling).
        output_final_state: whether to return the state after the last token (fla's name and
            default). Without it no ``[B, H, S, D]`` tensor is made: the forward and the
            backward work on the rows the sequence touches, so their time and memory do not
            grow with S (the gradient of ``bank`` itself, when it requires grad, is the one
            S-sized write).

    Returns:
        ``SDMOutput(out [B, T, H, D] in v's dtype, bank)``: ``bank`` is the final state
        ``[B, H, S, D]`` (``[N, H, S, D]`` with ``cu_seqlens``) in the bank's dtype with
        ``output_final_state=True``, else None.

    Example::

        >>> B, T, H, D, S, W, R = 2, 100, 4, 64, 4096, 8, 8
        >>> v = torch.randn(B, T, H, D)
        >>> beta = torch.rand(B, T, H)
        >>> write_idx = torch.randint(0, S, (B, T, H, W))
        >>> read_idx = torch.randint(0, S, (B, T, H, R))
        >>> out, bank = sdm_ops.sparse_delta_memory(
        ...     v, beta, write_idx, torch.rand(B, T, H, W), read_idx, torch.rand(B, T, H, R),
        ...     torch.zeros(H, S, D), output_final_state=True)
        >>> out.shape, bank.shape
        (torch.Size([2, 100, 4, 64]), torch.Size([2, 4, 4096, 64]))
    """
    _check_args(
        v,
        beta,
        write_idx,
        write_w,
        read_idx,
        read_w,
        bank,
        decay,
        chunk_size,
        snapshot,
        cu_seqlens,
        output_final_state,
        inplace=False,
    )
    _transforms.check(
        "sparse_delta_memory", v, beta, write_w, read_w, bank, decay, write_idx, read_idx
    )
    checks, cu_seqlens = _data_checks(
        write_idx, read_idx, bank.shape[-2], cu_seqlens, v.shape[1], defer=True
    )
    # Without autograd nothing is kept for a backward: no snapshot, and phase 2 runs in place
    # on a copy of the bank (what inference and evaluation pay).
    keep = _needs_grad(v, beta, write_w, read_w, bank, decay)
    out, bank_out, _ = eager.call(
        ops.sparse_delta_memory_route,
        v,
        beta,
        write_idx,
        write_w,
        read_idx,
        read_w,
        bank,
        decay,
        chunk_size,
        snapshot,
        cu_seqlens,
        output_final_state,
        keep_for_backward=keep,
    )
    _finish(checks)
    return SDMOutput(out, bank_out if output_final_state else None)


def sparse_delta_memory_(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    bank: Tensor,
    decay: Tensor | None = None,
    *,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """The recurrence of :func:`sparse_delta_memory`, updating ``bank`` in place; no autograd.

    The arguments are those of :func:`sparse_delta_memory`, in the same order.

    For inference and decoding: ``T`` may be 1, and a call on a GPU makes no host
    synchronization (strict checks aside, :func:`sdm_ops.set_strict_checks`), so the host
    queues decode steps ahead of the GPU and a step captures in a CUDA graph. ``bank`` is
    ``[B, H, S, D]`` and contiguous. A decode step (T = 1, no ``cu_seqlens``) runs as one
    kernel launch; longer sequences shorter than ``chunk_size`` run in one chunk of the
    smallest allowed size that holds them. Returns ``out [B, T, H, D]``.
    ``cu_seqlens`` packs N sequences as in :func:`sparse_delta_memory` (bank ``[N, H, S, D]``).

    Example::

        >>> B, T, H, D, S, W, R = 2, 1, 4, 64, 4096, 8, 8
        >>> bank = torch.zeros(B, H, S, D)
        >>> out = sdm_ops.sparse_delta_memory_(
        ...     torch.randn(B, T, H, D), torch.rand(B, T, H),
        ...     torch.randint(0, S, (B, T, H, W)), torch.rand(B, T, H, W),
        ...     torch.randint(0, S, (B, T, H, R)), torch.rand(B, T, H, R), bank)
        >>> out.shape, bool(bank.any())      # the bank now holds the token's writes
        (torch.Size([2, 1, 4, 64]), True)
    """
    _check_args(
        v,
        beta,
        write_idx,
        write_w,
        read_idx,
        read_w,
        bank,
        decay,
        chunk_size,
        "none",
        cu_seqlens,
        inplace=True,
    )
    _transforms.check(
        "sparse_delta_memory_", v, beta, write_w, read_w, bank, decay, write_idx, read_idx
    )
    if not bank.is_contiguous():
        raise ValueError("bank must be contiguous to be updated in place")
    # Every reason to refuse comes before anything is written. (Traced code cannot ask about
    # inference tensors; the compiled graph's own checks apply there.)
    if (
        not torch.compiler.is_compiling()
        and bank.is_inference()
        and not torch.is_inference_mode_enabled()
    ):
        raise ValueError(
            "bank is an inference tensor (made under torch.inference_mode()), which PyTorch "
            "lets no one update in place outside inference mode: call sparse_delta_memory_ "
            "inside torch.inference_mode(), or pass a bank made outside it"
        )
    if bank.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "bank requires grad, and sparse_delta_memory_ updates it in place without "
            "autograd: call it under torch.no_grad() (or pass bank.detach())"
        )
    _, cu_seqlens = _data_checks(
        write_idx, read_idx, bank.shape[-2], cu_seqlens, v.shape[1], defer=False
    )
    return eager.call(
        ops.sparse_delta_memory_inplace_route,
        v,
        beta,
        write_idx,
        write_w,
        read_idx,
        read_w,
        bank,
        decay,
        chunk_size,
        cu_seqlens,
    )
