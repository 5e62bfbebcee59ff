"""Operator checks of every operator: the public ``sdm::`` ones and the internal
``sdm_internal::`` ones.

* ``OpsNumerics`` tests call the public functions and the operators on small fresh random
  inputs and check the numbers against ``sdm_ops.reference`` (float64) or against identities
  that do not share code with the operators (``X M = I``, recomputed product-key scores, a
  dense autograd of the top-k scores, the token-by-token recurrence).
* ``generate_opcheck_tests`` turns each of those tests into schema, autograd-registration,
  fake-tensor and AOT-dispatch (dynamic shapes) checks of every operator of either namespace
  that the test calls itself (a public function calls its public operator once; the internal
  operators inside run with it), with ``tests/opcheck_failures.json`` empty: no check is
  expected to fail. The public functions pass their arguments' layouts on, so the tests with
  permuted inputs check the public operators on those layouts.
* ``test_opcheck_*`` call ``torch.library.opcheck`` on each operator directly: the public ones
  on contiguous and on dense permuted (non-contiguous) inputs, with and without inputs that
  require grad; the internal ones on contiguous inputs (their contract).

The CPU classes run the reference path of the operators; the CUDA ones run the Triton kernels
and are skipped without a GPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import unittest

import pytest
import torch
from torch.testing._internal.optests import generate_opcheck_tests

import sdm_ops
from sdm_ops import ops
from sdm_ops.layout import QUANT_GROUP, PairLists, Prepared
from sdm_ops.ops.recurrence import _chunk_betas
from sdm_ops.reference import (
    dequantize_rows,
    product_key_topk_bruteforce,
    sdm_chunked_reference,
    sdm_token_reference,
    sdm_varlen_reference,
    wy_solve_reference,
)
from tests.helpers import (
    HAS_CUDA,
    SDM_ORDER,
    assert_close,
    make_packed_sdm_inputs,
    make_raw,
    make_sdm_inputs,
    make_wy_inputs,
    requires_cuda,
    sdm_positional,
    to_float64,
)
from tests.oracle import FLOATS

FAILURES_DICT = os.path.join(os.path.dirname(__file__), "opcheck_failures.json")
RTOL = 1e-5  # float32 against float64 (the numerical contract)
BF16_RTOL = 3e-2  # bfloat16 inputs and bank: a few units of 2^-8 (as tests/test_recurrence.py)
OPCHECK_UTILS = [
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
]
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


# ---------------------------------------------------------------------------
# Input makers beside tests.helpers.make_sdm_inputs (CPU float32, then moved; fresh per seed)
# ---------------------------------------------------------------------------


def permuted_copy(t: torch.Tensor, perm) -> torch.Tensor:
    """A non-contiguous tensor equal to ``t``: stored in the dimension order ``perm``."""
    inv = [perm.index(i) for i in range(t.dim())]
    out = t.permute(perm).contiguous().permute(inv)
    assert torch.equal(out, t) and (t.dim() < 2 or not out.is_contiguous())
    return out


# A dense non-contiguous layout for each argument of the recurrence.
SDM_PERMS = {
    "v": (2, 0, 3, 1),
    "beta": (2, 1, 0),
    "write_idx": (3, 0, 2, 1),
    "write_w": (3, 1, 0, 2),
    "read_idx": (2, 3, 1, 0),
    "read_w": (3, 2, 1, 0),
    "bank": (3, 2, 1, 0),
    "decay": (1, 3, 0, 2),
}


def permuted_sdm_args(args: dict) -> dict:
    """``args`` of the recurrence (``make_sdm_inputs``'s dict), each stored in the dimension
    order of ``SDM_PERMS`` (a shared [H, S, D] bank in reverse order)."""
    perms = dict(SDM_PERMS, bank=SDM_PERMS["bank"] if args["bank"].dim() == 4 else (2, 1, 0))
    return {k: t if k not in perms else permuted_copy(t, perms[k]) for k, t in args.items()}


def dense_product_scores(raw: torch.Tensor, factors) -> torch.Tensor:
    """Every slot's score [..., prod(factors)], the float32 sum of one column per factor in
    factor order, row-major over the factors (differentiable)."""
    cols = torch.split(raw.float(), list(factors), dim=-1)
    score = cols[0]
    for col in cols[1:]:
        score = (score[..., :, None] + col[..., None, :]).flatten(-2)
    return score


def chunk_start_rows(args: dict, chunk_size: int) -> torch.Tensor:
    """[B, T, H, W + R, D] float64: the bank row of each write entry, then of each read entry,
    as it was at the start of the entry's chunk (the token recurrence run up to there), zero
    for padding."""
    a = to_float64(args)
    B, T, H, D = a["v"].shape
    E = a["write_idx"].shape[-1] + a["read_idx"].shape[-1]
    S = a["bank"].shape[-2]
    rows = torch.zeros(B, T, H, E, D, dtype=torch.float64)
    for t0 in range(0, T, chunk_size):
        head = {k: (v if k == "bank" else v[:, :t0]) for k, v in a.items()}
        _, M = sdm_token_reference(**head)  # [B, H, S, D]
        idx = torch.cat([a["write_idx"], a["read_idx"]], -1)[:, t0 : t0 + chunk_size]
        idx = idx.transpose(1, 2)  # [B, H, c, E]
        got = torch.gather(M, 2, idx.clamp(0, S - 1).reshape(B, H, -1, 1).expand(-1, -1, -1, D))
        got = got.reshape(*idx.shape, D).transpose(1, 2)
        rows[:, t0 : t0 + chunk_size] = torch.where((idx.transpose(1, 2) >= 0)[..., None], got, 0)
    return rows


def recurrence_values(args: dict, chunk_size: int) -> dict:
    """``args`` plus everything the internal recurrence operators take, by argument name:
    phase 1 (``chunk_prepare``, outputs named as ``reference.Prepared``, then ``pair_count`` and
    ``pair_entries``), the WY solve (X, QX),
    ``bank_rows`` and ``chunk_size``."""
    a = {k: v.contiguous() for k, v in args.items()}
    C, T = chunk_size, a["beta"].shape[1]
    chunks, seq_chunks = (
        (None, None) if "cu_seqlens" not in a else ops.varlen_chunks(a["cu_seqlens"], T, C)
    )
    values = dict(
        a,
        decay=a.get("decay"),
        bank_rows=a["bank"].shape[-2],
        chunk_size=C,
        chunks=chunks,
        seq_chunks=seq_chunks,
    )
    prep = ops.chunk_prepare(*op_args(ops.chunk_prepare, values))
    names = Prepared._fields + tuple("pair_" + f for f in PairLists._fields)
    assert len(prep) == len(names), "chunk_prepare no longer returns Prepared and PairLists"
    values.update(zip(names, prep))
    X, QX = ops.wy_solve(
        values["A"].reshape(-1, C, C),
        _chunk_betas(a["beta"], C, chunks),
        values["QK"].reshape(-1, C, C),
    )
    values.update(X=X.view(values["A"].shape), QX=QX.view(values["A"].shape))
    return values


def op_args(op, values: dict) -> tuple:
    """Positional arguments of ``op`` (a ``CustomOpDef``), taken from ``values`` by the names
    in its schema."""
    args = op._opoverload._schema.arguments
    return tuple(
        values[a.name] if a.name in values or not a.has_default_value() else a.default_value
        for a in args
    )


# ---------------------------------------------------------------------------
# Numerics, turned into opcheck tests by generate_opcheck_tests
# ---------------------------------------------------------------------------


class OpsNumerics:
    """Numerics of every operator on ``device``; mixed into one unittest class per device."""

    device = "cpu"

    # -- wy_solve -----------------------------------------------------------

    def test_wy_solve_inverts_and_gradients_match_float64(self):
        A, beta, QK = make_wy_inputs(3, 16, seed=1, device=self.device, requires_grad=True)
        X, QX = sdm_ops.wy_solve(A, beta, QK)
        self.assertTrue(X.is_contiguous() and QX.is_contiguous())
        A64, beta64, QK64 = (t.detach().cpu().double().requires_grad_() for t in (A, beta, QK))
        M = torch.eye(16, dtype=torch.float64) + torch.tril(beta64[..., None] * A64, -1)
        assert_close(
            X.detach().cpu().double() @ M.detach(),
            torch.eye(16, dtype=torch.float64).expand(3, 16, 16),
            rtol=RTOL,
            name="X M",
        )
        rX, rQX = wy_solve_reference(A64, beta64, QK64)
        assert_close(X, rX, rtol=RTOL, name="X")
        assert_close(QX, rQX, rtol=RTOL, name="QX")
        g = torch.Generator().manual_seed(2)
        dX, dQX = torch.randn(2, 3, 16, 16, generator=g)
        grads = torch.autograd.grad(
            (X, QX), (A, beta, QK), (dX.to(self.device), dQX.to(self.device))
        )
        rgrads = torch.autograd.grad((rX, rQX), (A64, beta64, QK64), (dX.double(), dQX.double()))
        for name, got, want in zip(("dA", "dbeta", "dQK"), grads, rgrads):
            assert_close(got, want, rtol=RTOL, name=name)

    def test_wy_solve_one_output_used_and_permuted_inputs(self):
        A, beta, QK = make_wy_inputs(4, 32, seed=3, device=self.device)
        A_p, QK_p = permuted_copy(A, (2, 0, 1)), permuted_copy(QK, (1, 2, 0))
        beta_p = permuted_copy(beta, (1, 0)).requires_grad_()
        A_p.requires_grad_()
        X, QX = sdm_ops.wy_solve(A_p, beta_p, QK_p)
        self.assertTrue(torch.equal(X, sdm_ops.wy_solve(A, beta, QK).X))
        (X * X).sum().backward()  # QX unused: its gradient is None
        A64, beta64 = (t.detach().cpu().double().requires_grad_() for t in (A, beta))
        rX, _ = wy_solve_reference(A64, beta64, QK.cpu().double())
        (rX * rX).sum().backward()
        assert_close(A_p.grad, A64.grad, rtol=RTOL, name="dA")
        assert_close(beta_p.grad, beta64.grad, rtol=RTOL, name="dbeta")

    # -- product_key_topk ---------------------------------------------------

    def _check_topk(self, raw, factors, k, val, lin):
        kk = min(k, math.prod(factors))
        self.assertEqual(tuple(val.shape), (*raw.shape[:-1], kk))
        self.assertEqual((val.dtype, lin.dtype), (raw.dtype, torch.int64))
        scores = dense_product_scores(raw.detach().cpu(), factors)
        lin_c = lin.cpu()
        self.assertTrue(bool((lin_c[..., 1:] > lin_c[..., :-1]).all()), "lin not ascending")
        torch.testing.assert_close(
            val.detach().cpu(), scores.gather(-1, lin_c).to(raw.dtype), rtol=0, atol=0
        )
        rest = scores.scatter(-1, lin_c, -math.inf)
        self.assertTrue(
            bool((scores.gather(-1, lin_c).amin(-1) >= rest.amax(-1)).all()),
            "a slot not selected scores higher than one selected",
        )
        rval, rlin = product_key_topk_bruteforce(raw.detach().cpu(), tuple(factors), k)
        self.assertTrue(torch.equal(lin_c, rlin))

    def test_product_key_topk_selects_best_slots_and_gradient_matches_dense(self):
        factors, k = (6, 5), 7
        raw = make_raw((2, 3), factors, seed=4, device=self.device, requires_grad=True)
        val, lin = sdm_ops.product_key_topk(raw, factors, k)
        self._check_topk(raw, factors, k, val, lin)
        g = torch.randn(val.shape, generator=torch.Generator().manual_seed(5))
        (grad,) = torch.autograd.grad(val, raw, g.to(self.device))
        raw_c = raw.detach().cpu().requires_grad_()
        (want,) = torch.autograd.grad(
            dense_product_scores(raw_c, factors).gather(-1, lin.cpu()), raw_c, g
        )
        assert_close(grad, want, rtol=0, atol=1e-6, name="grad raw")

    def test_product_key_topk_three_factors_k_past_product_permuted_raw(self):
        factors, k = (3, 2, 4), 30  # kk = 24: every slot, ascending
        raw = make_raw((5, 2), factors, seed=6, device=self.device)
        raw_p = permuted_copy(raw, (1, 0, 2))
        val, lin = sdm_ops.product_key_topk(raw_p, factors, k)
        self._check_topk(raw, factors, k, val, lin)
        self.assertTrue(torch.equal(lin.cpu(), torch.arange(24).expand(5, 2, 24)))

    def test_product_key_topk_bfloat16_four_factors_gradient(self):
        factors, k = (2, 3, 2, 3), 5
        raw = make_raw(
            (4,), factors, seed=7, device=self.device, dtype=torch.bfloat16, requires_grad=True
        )
        val, lin = sdm_ops.product_key_topk(raw, factors, k)
        self._check_topk(raw, factors, k, val, lin)
        val.float().sum().backward()
        self.assertEqual(raw.grad.dtype, torch.bfloat16)
        # Each selected slot adds 1 to one column per factor: every factor's block sums to kk.
        for block in torch.split(raw.grad.float().cpu(), list(factors), -1):
            self.assertTrue(torch.equal(block.sum(-1), torch.full((4,), 5.0)))

    # -- the recurrence (forward only) ----------------------------------------

    def _check_sdm(self, args, chunk_size, rtol=RTOL):
        out, bank = sdm_ops.sparse_delta_memory(
            **args, chunk_size=chunk_size, output_final_state=True
        )
        B, T, H, D = args["v"].shape
        self.assertEqual(tuple(out.shape), (B, T, H, D))
        self.assertEqual(tuple(bank.shape), (B, H, *args["bank"].shape[-2:]))
        self.assertEqual((out.dtype, bank.dtype), (args["v"].dtype, args["bank"].dtype))
        self.assertTrue(out.is_contiguous() and bank.is_contiguous())
        r_out, r_bank = sdm_token_reference(**to_float64(args))
        assert_close(out, r_out, rtol=rtol, name=f"out (chunk {chunk_size})")
        assert_close(bank, r_bank, rtol=rtol, name=f"bank (chunk {chunk_size})")
        return out, bank

    def test_sparse_delta_memory_with_decay_chunk16_matches_token_reference(self):
        args = make_sdm_inputs(
            2, 37, 2, 16, 24, 3, 2, seed=8, decay=True, shared=False, device=self.device
        )
        bank0 = args["bank"].clone()
        self._check_sdm(args, 16)
        self.assertTrue(torch.equal(args["bank"], bank0), "bank was modified")

    def test_sparse_delta_memory_shared_bank_int32_no_decay_chunk32_matches_token_reference(self):
        args = make_sdm_inputs(
            2,
            45,
            2,
            16,
            20,
            4,
            3,
            seed=9,
            decay=False,
            shared=True,
            index_dtype=torch.int32,
            device=self.device,
        )
        self._check_sdm(args, 32)

    def test_sparse_delta_memory_permuted_inputs_equal_contiguous(self):
        args = make_sdm_inputs(
            2, 20, 2, 16, 24, 2, 2, seed=10, decay=True, shared=False, device=self.device
        )
        permuted = permuted_sdm_args(args)
        for c in (16, 32):
            out, bank = sdm_ops.sparse_delta_memory(
                **permuted, chunk_size=c, output_final_state=True
            )
            want_out, want_bank = sdm_ops.sparse_delta_memory(
                **args, chunk_size=c, output_final_state=True
            )
            self.assertTrue(
                torch.equal(out, want_out) and torch.equal(bank, want_bank),
                f"chunk {c}: permuted inputs changed the result",
            )

    def test_sparse_delta_memory_bfloat16_within_rounding_of_float32(self):
        args = make_sdm_inputs(
            1,
            33,
            2,
            16,
            20,
            3,
            2,
            seed=11,
            decay=True,
            shared=True,
            dtype=torch.bfloat16,
            device=self.device,
        )
        # The reference runs on the same (bf16-rounded) values in float64.
        self._check_sdm(args, 16, rtol=BF16_RTOL)

    def test_sparse_delta_memory_inplace_matches_token_reference_prefill_and_decode(self):
        args = make_sdm_inputs(
            2,
            34,
            1,
            16,
            24,
            3,
            2,
            seed=12,
            decay=True,
            shared=False,
            index_dtype=torch.int32,
            device=self.device,
        )
        want_out, want_bank = sdm_token_reference(**to_float64(args))
        seq = {k: v for k, v in args.items() if k != "bank"}
        bank = args["bank"].clone()
        out = sdm_ops.sparse_delta_memory_(
            bank=bank, **{k: v[:, :32] for k, v in seq.items()}, chunk_size=16
        )
        assert_close(out, want_out[:, :32], rtol=RTOL, name="out (prefill)")
        for t in (32, 33):  # decode steps, T = 1
            step = sdm_ops.sparse_delta_memory_(
                bank=bank, **{k: v[:, t : t + 1] for k, v in seq.items()}
            )
            assert_close(step, want_out[:, t : t + 1], rtol=RTOL, name=f"out (step {t})")
        assert_close(bank, want_bank, rtol=RTOL, name="bank")

    def test_sparse_delta_memory_packed_batch_equals_each_sequence_alone(self):
        args = make_packed_sdm_inputs(
            [4, 0, 21, 16], 2, 16, 20, 3, 2, seed=14, decay=True, device=self.device
        )
        cu = args.pop("cu_seqlens").long()  # int64 offsets (the helper gives int32)
        out, bank = sdm_ops.sparse_delta_memory(
            **args, cu_seqlens=cu, chunk_size=16, output_final_state=True
        )
        want_out, want_bank = sdm_varlen_reference(
            **to_float64(args), cu_seqlens=cu.cpu(), chunk_size=16
        )
        assert_close(out, want_out, rtol=RTOL, name="out")
        assert_close(bank, want_bank, rtol=RTOL, name="bank")

    def test_sparse_delta_memory_gradients_match_float64_reference_permuted_inputs(self):
        args = make_sdm_inputs(
            1, 21, 2, 16, 12, 3, 2, seed=15, decay=True, shared=True, device=self.device
        )
        floats = ("v", "beta", "write_w", "read_w", "bank", "decay")
        leaves = {k: permuted_sdm_args(args)[k].requires_grad_() for k in floats}
        out, bank = sdm_ops.sparse_delta_memory(
            **dict(args, **leaves), chunk_size=16, output_final_state=True
        )
        g = torch.Generator().manual_seed(16)
        g_out, g_bank = torch.randn(out.shape, generator=g), torch.randn(bank.shape, generator=g)
        grads = torch.autograd.grad(
            (out, bank),
            [leaves[k] for k in floats],
            (g_out.to(self.device), g_bank.to(self.device)),
        )
        a64 = to_float64(args)
        for k in floats:
            a64[k].requires_grad_()
        r_out, r_bank = sdm_chunked_reference(**a64, chunk_size=16)
        want = torch.autograd.grad(
            (r_out, r_bank), [a64[k] for k in floats], (g_out.double(), g_bank.double())
        )
        for k, got, ref in zip(floats, grads, want):
            assert_close(got, ref, rtol=RTOL, name=f"d{k}")

    def test_recurrence_fwd_snapshots_hold_chunk_start_rows(self):
        args = make_sdm_inputs(
            1, 40, 2, 32, 16, 3, 2, seed=13, decay=True, shared=False, device=self.device
        )
        C = 16
        values = recurrence_values(args, C)
        rows = chunk_start_rows(args, C)
        want_out, want_bank = sdm_chunked_reference(**to_float64(args), chunk_size=C)
        # Quantization error bounds: bf16 2^-9 of each value; fp8 (e4m3) 2^-4 of each value;
        # int4 half a step (1/14 of the group's largest magnitude), each with float32 slack.
        for mode, tol in (("none", RTOL), ("bf16", 2**-8), ("fp8", 2**-3), ("int4", 1 / 14 + 1e-4)):
            out, bank, snap, scale = ops.recurrence_fwd(
                *op_args(ops.recurrence_fwd, dict(values, snapshot=mode))
            )[:4]
            assert_close(out, want_out, rtol=RTOL, name=f"out ({mode})")
            assert_close(bank, want_bank, rtol=RTOL, name=f"bank ({mode})")
            got = dequantize_rows(snap.cpu(), scale.cpu(), mode).double()
            if mode in ("fp8", "int4"):  # error relative to each group's largest magnitude
                amax = rows.unflatten(-1, (-1, QUANT_GROUP)).abs().amax(-1, keepdim=True)
                err = (got - rows).unflatten(-1, (-1, QUANT_GROUP)).abs() / amax.clamp(min=1e-30)
                self.assertLessEqual(err.max().item(), tol, f"snapshot {mode}")
            else:
                assert_close(got, rows, rtol=tol, name=f"snapshot ({mode})")


class TestOpsNumericsCPU(OpsNumerics, unittest.TestCase):
    device = "cpu"


@pytest.mark.cuda
@unittest.skipIf(not HAS_CUDA, "needs a CUDA GPU")
class TestOpsNumericsCUDA(OpsNumerics, unittest.TestCase):
    device = "cuda"


def _generate_opcheck_tests(case: type) -> None:
    generate_opcheck_tests(
        case,
        [ops.PUBLIC, ops.INTERNAL],
        failures_dict_path=FAILURES_DICT,
        additional_decorators={},
        test_utils=OPCHECK_UTILS,
    )


_generate_opcheck_tests(TestOpsNumericsCPU)
_generate_opcheck_tests(TestOpsNumericsCUDA)


def test_failures_dict_is_empty():
    with open(FAILURES_DICT) as f:
        data = json.load(f)["data"]
    assert data == {}, f"{FAILURES_DICT} lists expected failures: {sorted(data)}"


def registered_operators(namespace: str) -> set[str]:
    """The names of the operators registered in ``namespace``."""
    return {
        name.split("::", 1)[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.split("::", 1)[0] == namespace
    }


def test_the_public_namespace_holds_exactly_the_public_operators():
    assert registered_operators("sdm") == {
        "sparse_delta_memory",
        "sparse_delta_memory_",
        "product_key_topk",
        "wy_solve",
    }
    for name in ("sparse_delta_memory", "sparse_delta_memory_", "product_key_topk", "wy_solve"):
        assert getattr(ops, name)._qualname == f"sdm::{name}"
        assert getattr(sdm_ops, name).__module__ != "sdm_ops.ops", name  # the checked wrapper
    assert {
        "chunk_prepare",
        "recurrence_fwd",
        "recurrence_bwd",
        "wy_solve_backward",
        "wy_solve_reference",
    } <= registered_operators("sdm_internal")


# ---------------------------------------------------------------------------
# torch.library.opcheck, operator by operator
# ---------------------------------------------------------------------------

# The CPU branch of each internal operator (and of sdm::wy_solve and sdm::product_key_topk)
# calls its opaque reference operator (ops._define.kernel_op), named <op>_reference except here.
REFERENCE_TWINS = {
    "recurrence_fwd_": "recurrence_fwd_inplace_reference",
    "decode_step_": "decode_step_inplace_reference",
}


def reference_twin(name: str) -> str | None:
    """The qualified name of the reference operator that ``name``'s CPU branch calls, if any
    (the public recurrence operators call internal operators instead)."""
    twin = f"{ops.INTERNAL}::{REFERENCE_TWINS.get(name, f'{name}_reference')}"
    return twin if twin in torch._C._dispatch_get_all_op_names() else None


def opcheck(op, args, kwargs=None):
    """opcheck ``op`` and, on CPU, the reference operator its CPU branch calls."""
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    twin = reference_twin(op._qualname.split("::", 1)[1])
    if twin is not None and tensors and all(t.device.type == "cpu" for t in tensors):
        namespace, name = twin.split("::")
        plain = tuple(
            a.detach().clone().contiguous() if isinstance(a, torch.Tensor) else a for a in args
        )
        torch.library.opcheck(
            getattr(getattr(torch.ops, namespace), name).default, plain, test_utils=OPCHECK_UTILS
        )


LAYOUTS = ["contiguous", "permuted"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_wy_solve(device, requires_grad, layout):
    A, beta, QK = make_wy_inputs(3, 16, seed=20, device=device)
    if layout == "permuted":
        A, beta, QK = (
            permuted_copy(A, (2, 0, 1)),
            permuted_copy(beta, (1, 0)),
            permuted_copy(QK, (1, 2, 0)),
        )
    opcheck(ops.wy_solve, tuple(t.requires_grad_(requires_grad) for t in (A, beta, QK)))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_wy_solve_backward(device):
    A, beta, QK = make_wy_inputs(2, 32, seed=21, device=device)
    X, _ = ops.wy_solve(A, beta, QK)
    dX, dQX = torch.randn(2, 2, 32, 32, generator=torch.Generator().manual_seed(22)).to(device)
    opcheck(ops.wy_solve_backward, (A, beta, QK, X, dX, dQX))


TOPK_CASES = [
    ((5,), 3, torch.float32),
    ((6, 5), 7, torch.float32),
    ((3, 2, 4), 30, torch.float32),
    ((2, 3, 2, 3), 5, torch.bfloat16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factors,k,dtype", TOPK_CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_product_key_topk(device, factors, k, dtype, requires_grad):
    raw = make_raw(
        (3, 2), factors, seed=23, device=device, dtype=dtype, requires_grad=requires_grad
    )
    opcheck(ops.product_key_topk, (raw, list(factors), k))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_product_key_topk_permuted_raw(device, requires_grad):
    raw = permuted_copy(make_raw((3, 2), (6, 5), seed=33, device=device), (1, 2, 0))
    opcheck(ops.product_key_topk, (raw.requires_grad_(requires_grad), [6, 5], 7))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factors,k,dtype", TOPK_CASES)
def test_opcheck_product_key_topk_backward(device, factors, k, dtype):
    raw = make_raw((3, 2), factors, seed=24, device=device, dtype=dtype)
    _, lin = ops.product_key_topk(raw, list(factors), k)
    grad_val = torch.randn(lin.shape, generator=torch.Generator().manual_seed(25)).to(device, dtype)
    opcheck(ops.product_key_topk_backward, (lin, grad_val, list(factors), dtype))


def sdm_operands(
    device, *, packed=False, shared=False, layout="contiguous", T=21, requires_grad=False
) -> tuple[tuple, dict]:
    """(positional arguments of ``sdm::sparse_delta_memory`` up to decay, {"cu_seqlens": ...}
    for a packed batch of sequences of lengths 0, 5, T and 17, else {}), in ``layout``; the
    float arguments require grad with ``requires_grad``."""
    if packed:
        a = make_packed_sdm_inputs(
            [0, 5, T, 17], 2, 16, 20, 3, 2, seed=26, decay=True, shared=shared, device=device
        )
        extra = {"cu_seqlens": a.pop("cu_seqlens")}
    else:
        a = make_sdm_inputs(
            2, T, 2, 16, 20, 3, 2, seed=26, decay=True, shared=shared, device=device
        )
        extra = {}
    if layout == "permuted":
        a = permuted_sdm_args(a)
    if requires_grad:
        a = {k: t.requires_grad_() if k in FLOATS else t for k, t in a.items()}
    return tuple(sdm_positional(a)), extra


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "packed,shared,requires_grad,options",
    [
        # Keeping what the backward reads: the float inputs require grad.
        (False, False, True, dict(snapshot="none", output_final_state=True)),
        (False, True, True, dict(snapshot="int4", output_final_state=True)),
        (True, False, True, dict(snapshot="fp8", output_final_state=True)),
        (False, False, True, dict(snapshot="bf16", output_final_state=False)),
        (False, True, True, dict(snapshot="none", output_final_state=False)),
        (True, True, True, dict(snapshot="none", output_final_state=False)),
        # The inference forward: nothing kept.
        (False, False, False, dict(keep_for_backward=False, output_final_state=True)),
        (False, True, False, dict(keep_for_backward=False, output_final_state=True)),
        (True, False, False, dict(keep_for_backward=False, output_final_state=True)),
        (False, True, False, dict(keep_for_backward=False, output_final_state=False)),
    ],
)
def test_opcheck_sparse_delta_memory(device, layout, packed, shared, requires_grad, options):
    args, extra = sdm_operands(
        device, packed=packed, shared=shared, layout=layout, requires_grad=requires_grad
    )
    opcheck(ops.sparse_delta_memory, args, dict(extra, chunk_size=16, **options))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,packed", [(21, False), (1, False), (21, True)])
def test_opcheck_sparse_delta_memory_inplace(device, layout, T, packed):
    """A prefill, a decode step (T = 1) and a packed batch, the bank updated in place (in a
    permuted layout: through a contiguous copy)."""
    args, extra = sdm_operands(device, packed=packed, layout=layout, T=T)
    opcheck(ops.sparse_delta_memory_, args, dict(extra, chunk_size=16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("programs", [0, 1])
def test_opcheck_bank_copy(device, shared, programs):
    a = make_sdm_inputs(3, 1, 2, 16, 5, 2, 2, seed=32, shared=shared, device=device)
    opcheck(ops.bank_copy, (a["bank"], 3, programs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [False, True], ids=["per_stream", "shared"])
def test_opcheck_rows_to_bank(device, shared):
    # 3 banks of 2 heads, U = 4 rows a stream over S = 6 slots; unused rows are -1.
    g = torch.Generator().manual_seed(33)
    grad_rows = torch.randn(3, 2, 4, 16, generator=g).to(device)
    row_slots = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(6)])
    row_slots[1, 2:] = -1
    opcheck(ops.rows_to_bank, (grad_rows, row_slots.to(device), 6, shared))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_opcheck_varlen_chunks(device, dtype):
    cu = torch.tensor([0, 0, 5, 21, 58, 59, 59, 79], dtype=dtype, device=device)
    opcheck(ops.varlen_chunks, (cu, 79, 16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decay", [False, True])
def test_opcheck_finite_select(device, decay):
    # Padding and an infinite read weight (a non-finite write would make phase 2's beta NaN,
    # which opcheck's comparisons take for a difference; tests/test_nonfinite.py checks those).
    a = make_sdm_inputs(2, 9, 2, 16, 5, 3, 2, seed=34, decay=decay, device=device)
    a["read_w"][0, 4, 0, 1] = -float("inf")
    args = tuple(a.get(k) for k in ("beta", "write_idx", "write_w", "read_idx", "read_w", "decay"))
    opcheck(ops.finite_select, (*args, 5))


def recurrence_operands(device, T=21, C=16, packed=False) -> dict:
    """Inputs of the internal recurrence operators by name (decay, per-batch bank, chunk size
    C); with ``packed``, sequences of lengths 0, 5, T and 17 packed into one batch."""
    if not packed:
        args = make_sdm_inputs(
            2, T, 2, 16, 20, 3, 2, seed=26, decay=True, shared=False, device=device
        )
        return recurrence_values(args, C)
    args = make_packed_sdm_inputs(
        [0, 5, T, 17], 2, 16, 20, 3, 2, seed=26, decay=True, device=device
    )
    return recurrence_values(args, C)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_chunk_prepare(device, packed):
    values = recurrence_operands(device, packed=packed)
    opcheck(ops.chunk_prepare, op_args(ops.chunk_prepare, values))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_wy_solve_pairs(device, packed):
    values = recurrence_operands(device, packed=packed)
    C, entries = values["chunk_size"], values["pair_entries"]
    args = (
        values["A"].reshape(-1, C, C),
        _chunk_betas(values["beta"], C, values["chunks"]),
        values["QK"].reshape(-1, C, C),
        values["pair_count"].reshape(-1),
        entries.reshape(-1, entries.shape[-1]),
    )
    opcheck(ops.wy_solve_pairs, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_recurrence_fwd(device, packed):
    values = recurrence_operands(device, packed=packed)
    opcheck(ops.recurrence_fwd, op_args(ops.recurrence_fwd, dict(values, snapshot="int4")))


def backward_operands(device, snapshot="none", packed=False) -> dict:
    """Inputs of the backward operators by name: a forward's saved tensors and gradients."""
    values = recurrence_operands(device, packed=packed)
    out, bank_out, snap, snap_scale, res, delta = ops.recurrence_fwd(
        *op_args(ops.recurrence_fwd, dict(values, snapshot=snapshot))
    )
    g = torch.Generator().manual_seed(27)
    grad = {
        n: torch.randn(values[src].shape, generator=g).to(device)
        for n, src in (
            ("dA", "A"),
            ("dQK", "QK"),
            ("d_gather_w", "gather_w"),
            ("d_gather_r", "gather_r"),
            ("d_scatter_w", "scatter_w"),
            ("d_row_decay", "row_decay"),
        )
    }
    return dict(
        values,
        **grad,
        snap=snap,
        snap_scale=snap_scale,
        res=res,
        delta=delta,
        solve_beta=values["beta"],
        snapshot=snapshot,
        v_dtype=values["v"].dtype,
        dout=torch.randn(out.shape, generator=g).to(device),
        dbank_out=torch.randn(bank_out.shape, generator=g).to(device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("snapshot,packed", [("none", False), ("fp8", False), ("none", True)])
def test_opcheck_recurrence_bwd(device, snapshot, packed):
    values = backward_operands(device, snapshot, packed)
    opcheck(ops.recurrence_bwd, op_args(ops.recurrence_bwd, values))
    opcheck(ops.recurrence_bwd, op_args(ops.recurrence_bwd, dict(values, dout=None)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_chunk_prepare_backward(device, packed):
    values = backward_operands(device, packed=packed)
    opcheck(ops.chunk_prepare_backward, op_args(ops.chunk_prepare_backward, values))
    opcheck(
        ops.chunk_prepare_backward, op_args(ops.chunk_prepare_backward, dict(values, decay=None))
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_recurrence_fwd_inplace_decode_step(device, packed):
    values = recurrence_operands(device, T=1, packed=packed)
    opcheck(ops.recurrence_fwd_, op_args(ops.recurrence_fwd_, values))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decay", [True, False])
def test_opcheck_decode_step(device, decay):
    """One token per stream, duplicate slots within the token (S = 5, W = 6)."""
    a = make_sdm_inputs(3, 1, 2, 32, 5, 6, 4, seed=31, decay=decay, shared=False, device=device)
    opcheck(
        ops.decode_step_,
        (a["bank"].clone(), *(a.get(k) for k in SDM_ORDER if k != "bank")),
    )


# Operators whose direct opcheck test lives elsewhere or is still to come, and why (qualified
# names).
OPCHECK_PENDING: dict[str, str] = {}


def test_every_operator_has_a_direct_opcheck_test():
    registered = {
        f"{ns}::{name}" for ns in (ops.PUBLIC, ops.INTERNAL) for name in registered_operators(ns)
    }
    with open(__file__) as f:
        names = set(re.findall(r"\bopcheck\(\s*ops\.(\w+),", f.read()))
    checked = {getattr(ops, name)._qualname for name in names}
    checked |= {reference_twin(q.split("::", 1)[1]) for q in checked} - {None}  # opcheck() does
    missing = registered - checked - set(OPCHECK_PENDING)
    assert not missing, f"operators with no opcheck(ops.<op>, ...) call here: {sorted(missing)}"
    stale = set(OPCHECK_PENDING) - (registered - checked)
    assert not stale, f"OPCHECK_PENDING lists checked or unknown operators: {sorted(stale)}"
