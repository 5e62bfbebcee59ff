"""The ``SparseDeltaMemory`` layer: ``[B, T, d_model] -> [B, T, d_model]``.

Per head, a read query and a write key address the bank through exact product-key top-k over
learned sub-keys; the selected scores, softmax-normalized over the k slots, are the read and
write weights of the sparse delta memory recurrence, which runs from a learned initial bank.
Gradients reach every projection through ``product_key_topk``'s ``val`` and the recurrence.
No host synchronization and no data-dependent Python control flow: the layer compiles with
``torch.compile(fullgraph=True)`` and dynamic sequence lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import FLOAT_DTYPES, check_int, check_shape, check_tensor
from .layout import SNAPSHOT_MODES
from .product_key import check_factors, product_key_topk
from .recurrence import (
    CHUNK_SIZES,
    HEAD_DIMS,
    MAX_ENTRIES,
    sparse_delta_memory,
    sparse_delta_memory_,
)

MAX_SLOTS = 1 << 20
DECAY_BIAS = 4.0  # sigmoid(4) ~ 0.982: slots start close to no decay


def _plain_linear(m: nn.Module) -> bool:
    """Whether ``m`` is an ``nn.Linear`` itself (no subclass or wrapper) with no module hooks:
    its output is then ``F.linear`` of its own weight and bias."""
    hooks = (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)
    return type(m) is nn.Linear and not any(hooks)


class SparseDeltaMemory(nn.Module):
    """A sparse delta memory layer: ``x [B, T, d_model] -> y [B, T, d_model]``.

    For each head h, token t projects

    - a read query (``q_proj``) and a write key (``k_proj``), each ``[F, key_dim]`` (one
      vector per factor); factor f's scores are their dots with the learned sub-keys
      ``sub_keys[h, f] [factors[f], key_dim]`` (shared by reads and writes, so a query finds
      the slots a matching key wrote), scaled by ``key_dim ** -0.5``:
      ``raw [B, T, H, sum(factors)]``;
    - ``product_key_topk(raw, factors, k)`` picks the ``k`` best of ``S = prod(factors)`` slots
      (``read_topk`` for the read, ``write_topk`` for the write); the softmax of their scores
      over the k slots is ``read_w`` / ``write_w`` and the slot indices are ``read_idx`` /
      ``write_idx`` ``[B, T, H, k]`` (int64);
    - a value ``v [B, T, H, D]`` (``v_proj``), a write strength ``beta = sigmoid(.) [B, T, H]``
      (``b_proj``) and, with ``use_decay=True``, a decay ``sigmoid(. + 4) [B, T, H]``
      (``decay_proj``) applied to every slot the token writes;

    runs :func:`sdm_ops.sparse_delta_memory` from the learned initial bank ``bank [H, S, D]``
    (zeros at init) or a given state, and projects the heads' outputs ``[B, T, H * D]`` back
    to ``d_model`` (``o_proj``).

    Args:
        d_model: input and output width.
        heads: number of heads H (independent banks).
        head_dim: D, the bank's row width, one of 16, 32, 64, 128, 256.
        factors: product-key factor sizes, 1 to 4 ints; each head's bank has
            ``S = prod(factors)`` slots (at most 2^20), e.g. ``(32, 32)`` -> 1024.
        read_topk: R, slots each token reads, 1 to 64 (capped at S).
        write_topk: W, slots each token writes, 1 to 64 (capped at S).
        use_decay: whether written slots decay before the write (a learned gate per token and
            head, ``decay_proj``).
        chunk_size: the recurrence's chunk, one of 16, 32, 64, 128.
        snapshot: the recurrence's backward snapshot, "none", "bf16", "fp8" or "int4".
        key_dim: width of the query/key vectors dotted with the sub-keys (default 32).

    Shapes:
        ``forward(x [B, T, d_model], state [B, H, S, D] | None) -> y [B, T, d_model]``,
        and ``(y, final_bank [B, H, S, D])`` with ``return_state=True``. With
        ``cu_seqlens [N + 1]`` (variable-length sequences packed into x ``[1, T, d_model]``,
        as in :func:`sdm_ops.sparse_delta_memory`) the state and final bank are
        ``[N, H, S, D]`` and each sequence starts from its own state (or the initial bank).

    Example::

        >>> layer = SparseDeltaMemory(d_model=64, heads=2, head_dim=32, factors=(16, 16),
        ...                           read_topk=4, write_topk=4)
        >>> x = torch.randn(3, 40, 64)
        >>> y, state = layer(x[:, :30], return_state=True)     # a prompt
        >>> y_next = layer.step_(x[:, 30:31], state)           # decode one token in place
        >>> y.shape, state.shape
        (torch.Size([3, 30, 64]), torch.Size([3, 2, 256, 32]))
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        head_dim: int,
        factors: Sequence[int],
        read_topk: int,
        write_topk: int,
        use_decay: bool = True,
        chunk_size: int = 64,
        snapshot: str = "none",
        *,
        key_dim: int = 32,
    ):
        super().__init__()
        check_int("d_model", d_model, low=1)
        check_int("heads", heads, low=1)
        check_int("head_dim", head_dim, choices=HEAD_DIMS)
        factors = check_factors(factors)
        S = math.prod(factors)
        if S > MAX_SLOTS:
            raise ValueError(
                f"factors must address at most {MAX_SLOTS} slots, got prod({list(factors)}) = {S}"
            )
        check_int("read_topk", read_topk, low=1, high=MAX_ENTRIES)
        check_int("write_topk", write_topk, low=1, high=MAX_ENTRIES)
        if not isinstance(use_decay, bool):
            raise TypeError(f"use_decay must be a bool, got {type(use_decay).__name__}")
        check_int("chunk_size", chunk_size, choices=CHUNK_SIZES)
        if not isinstance(snapshot, str) or snapshot not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot must be one of {list(SNAPSHOT_MODES)}, got {snapshot!r}")
        check_int("key_dim", key_dim, low=1)

        self.d_model, self.heads, self.head_dim = d_model, heads, head_dim
        self.factors, self.slots, self.key_dim = factors, S, key_dim
        self.read_topk, self.write_topk = read_topk, write_topk
        self.use_decay, self.chunk_size, self.snapshot = use_decay, chunk_size, snapshot

        H, Fn = heads, len(factors)
        self.q_proj = nn.Linear(d_model, H * Fn * key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, H * Fn * key_dim, bias=False)
        self.sub_keys = nn.Parameter(torch.randn(H, sum(factors), key_dim) / math.sqrt(key_dim))
        self.v_proj = nn.Linear(d_model, H * head_dim, bias=False)
        self.b_proj = nn.Linear(d_model, H)
        self.decay_proj = nn.Linear(d_model, H) if use_decay else None
        if self.decay_proj is not None:
            nn.init.constant_(self.decay_proj.bias, DECAY_BIAS)
        self.bank = nn.Parameter(torch.zeros(H, S, head_dim))
        self.o_proj = nn.Linear(H * head_dim, d_model, bias=False)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, heads={self.heads}, head_dim={self.head_dim}, "
            f"factors={self.factors}, read_topk={self.read_topk}, "
            f"write_topk={self.write_topk}, use_decay={self.use_decay}, "
            f"chunk_size={self.chunk_size}, snapshot={self.snapshot!r}"
        )

    def _scores(self, qk: Tensor) -> Tensor:
        """qk [B * T, 2 * H * F * key_dim] (the read queries, then the write keys) -> raw
        [2, B, T, H, sum(factors)]: each factor's vector dotted with that factor's sub-keys,
        for the reads (raw[0]) and the writes (raw[1]) in one batched product."""
        BT = qk.shape[0]
        H, Fn, K = self.heads, len(self.factors), self.key_dim
        # [2 * H * F, B * T, K] as a view: batch (reads or writes, head, factor).
        q = (qk * K**-0.5).view(BT, 2 * H * Fn, K).transpose(0, 1)
        if len(set(self.factors)) == 1:
            # Equal factors (the usual case): one product for every (head, factor), whose
            # [.., F, n] result is already the concatenation of the factors' blocks.
            n = self.factors[0]
            keys = self.sub_keys.reshape(H * Fn, n, K)
            s = torch.bmm(q, torch.cat([keys, keys]).mT)  # [2 * H * F, B * T, n]
            return s.view(2, H, Fn, BT, n).permute(0, 3, 1, 2, 4).reshape(2, BT, H, Fn * n)
        q = q.view(2, H, Fn, BT, K)
        raw = []
        for f, keys in enumerate(self.sub_keys.split(self.factors, dim=1)):
            # keys [H, factors[f], key_dim]: one product for the reads and writes of factor f.
            s = torch.bmm(q[:, :, f].reshape(2 * H, BT, K), torch.cat([keys, keys]).mT)
            raw.append(s.view(2, H, BT, keys.shape[1]).transpose(1, 2))
        return torch.cat(raw, dim=-1)

    def _projections(self, x: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
        """x [B * T, d_model] -> (q and k side by side [B * T, 2 * H * F * key_dim], v
        [B * T, H * D], the gates' pre-activations [B * T, H]: beta's, then decay's).

        One matrix product against the projections' weights side by side (one operation
        rather than one or two for each projection; the modules keep their own parameters).
        A projection that is not a plain ``nn.Linear`` without hooks (an adapter, a module
        sharded on its own) runs through its own forward instead."""
        linears = [self.q_proj, self.k_proj, self.v_proj, self.b_proj]
        if self.decay_proj is not None:
            linears.append(self.decay_proj)
        gates = linears[3:]
        if not all(map(_plain_linear, linears)):
            qk = torch.cat([self.q_proj(x), self.k_proj(x)], dim=1)
            return qk, self.v_proj(x), [m(x) for m in gates]
        z = F.linear(x, torch.cat([m.weight for m in linears]))
        qk, v, *g = z.split(
            [2 * self.q_proj.out_features, self.v_proj.out_features] + [self.heads] * len(gates),
            dim=1,
        )
        return qk, v, [gi + m.bias for gi, m in zip(g, gates)]

    def _inputs(self, x: Tensor) -> dict[str, Tensor | None]:
        """The recurrence's per-token arguments from x [B, T, d_model]: the projections
        (``_projections``), then the read and write addressing as one batched product
        (``_scores``) and, with read_topk equal to write_topk, one top-k."""
        B, T, d = x.shape
        H, D = self.heads, self.head_dim
        qk, v, g = self._projections(x.reshape(B * T, d))
        beta = torch.sigmoid(g[0]).view(B, T, H)
        raw = self._scores(qk).unflatten(1, (B, T))  # [2, B, T, H, sum(factors)]
        if self.read_topk == self.write_topk:
            val, idx = product_key_topk(raw, self.factors, self.read_topk)
            w = torch.softmax(val.float(), dim=-1).to(x.dtype)
            (read_idx, write_idx), (read_w, write_w) = idx, w
        else:
            read_idx, read_w = self._address(raw[0], self.read_topk, x.dtype)
            write_idx, write_w = self._address(raw[1], self.write_topk, x.dtype)
        decay = None
        if self.decay_proj is not None:
            decay = torch.sigmoid(g[1]).view(B, T, H, 1).expand_as(write_w)
        return dict(
            v=v.view(B, T, H, D),
            beta=beta,
            write_idx=write_idx,
            write_w=write_w,
            read_idx=read_idx,
            read_w=read_w,
            decay=decay,
        )

    def _address(self, raw: Tensor, k: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Slot indices [B, T, H, kk] (int64) and their softmax weights from ``raw``."""
        val, idx = product_key_topk(raw, self.factors, k)
        return idx, torch.softmax(val.float(), dim=-1).to(dtype)

    def _output(self, out: Tensor) -> Tensor:
        B, T = out.shape[:2]
        return self.o_proj(out.reshape(B, T, self.heads * self.head_dim))

    def initial_state(self, batch_size: int) -> Tensor:
        """A fresh ``[B, H, S, D]`` state (a copy of the learned initial bank, detached) for
        :meth:`step_`."""
        return self.bank.detach().expand(batch_size, -1, -1, -1).clone()

    def _check_x(self, x: Tensor) -> None:
        check_tensor("x", x, ndim=3)
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape [B, T, d_model = {self.d_model}], got {list(x.shape)}"
            )
        weight = self.v_proj.weight  # x's first consumers: the projections
        want = weight.dtype
        # Under autocast the projections cast x themselves: any floating dtype is accepted.
        if x.dtype != want and not (
            x.is_floating_point() and torch.is_autocast_enabled(x.device.type)
        ):
            raise TypeError(
                f"x must have the layer's parameter dtype "
                f"{str(want).replace('torch.', '')}, got {x.dtype}"
            )
        if x.device != weight.device:
            raise ValueError(
                f"x is on {x.device} but the layer's parameters are on "
                f"{weight.device}; x must be on the layer's device"
            )

    @staticmethod
    def _check_cu_seqlens(cu_seqlens) -> None:
        """Its type only: :func:`sdm_ops.sparse_delta_memory` checks the rest."""
        if cu_seqlens is not None:
            check_tensor("cu_seqlens", cu_seqlens)

    def _check_state(
        self, state: Tensor, x: Tensor, cu_seqlens: Tensor | None, *, inplace: bool
    ) -> None:
        check_tensor("state", state, ndim=4, dtypes=FLOAT_DTYPES)
        if cu_seqlens is None:
            lead, what = x.shape[0], "[B, H, S, D]"
        else:
            lead, what = cu_seqlens.shape[0] - 1, "[N, H, S, D] (N sequences in cu_seqlens)"
        check_shape("state", state, (lead, self.heads, self.slots, self.head_dim), what)
        if state.device != x.device:
            raise ValueError(
                f"state is on {state.device} but x is on {x.device}; they must be on one device"
            )
        if inplace and not state.is_contiguous():
            raise ValueError("state must be contiguous to be updated in place by step_")

    def forward(
        self,
        x: Tensor,
        state: Tensor | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """``x [B, T, d_model]`` -> ``y [B, T, d_model]``, or ``(y, final_bank [B, H, S, D])``
        with ``return_state`` (only then is a final bank made). With ``state [B, H, S, D]``
        (a previous call's final bank) the recurrence continues from it instead of the learned
        initial bank. ``cu_seqlens`` packs variable-length sequences into ``x [1, T, d_model]``
        (see the class)."""
        self._check_x(x)
        self._check_cu_seqlens(cu_seqlens)
        if state is not None:
            self._check_state(state, x, cu_seqlens, inplace=False)
        a = self._inputs(x)
        bank = self.bank if state is None else state
        out, final = sparse_delta_memory(
            **a,
            bank=bank,
            chunk_size=self.chunk_size,
            snapshot=self.snapshot,
            cu_seqlens=cu_seqlens,
            output_final_state=return_state,
        )
        y = self._output(out)
        return (y, final) if return_state else y

    @torch.no_grad()
    def step_(self, x: Tensor, state: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        """Inference: continue from ``state [B, H, S, D]`` (contiguous, updated in place) over
        ``x [B, T, d_model]`` (T may be 1); no autograd. Returns ``y [B, T, d_model]``, equal
        to what :meth:`forward` gives for these tokens after the same history. With
        ``cu_seqlens``, x is ``[1, T, d_model]`` and state ``[N, H, S, D]``."""
        self._check_x(x)
        self._check_cu_seqlens(cu_seqlens)
        self._check_state(state, x, cu_seqlens, inplace=True)
        a = self._inputs(x)
        out = sparse_delta_memory_(
            **a,
            bank=state,
            chunk_size=self.chunk_size,
            cu_seqlens=cu_seqlens,
        )
        return self._output(out)
