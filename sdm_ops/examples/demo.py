"""The main job: the operators on a real example, then a model that learns to recall.

``python -m sdm_ops.demo`` first addresses a bank of 4096 slots per head with exact product-key
top-k (``product_key_topk``), writes key-value pairs with the delta rule
(``sparse_delta_memory``), reads every key back, and checks each operator against the float64
reference (and the top-k against the brute force), printing what it checked. Then it trains a
small model built on ``sdm_ops.nn.SparseDeltaMemory`` on multi-query associative recall under
``torch.compile(fullgraph=True)`` (``sdm_ops.examples.mqar``), printing when it compiles and how
long compiling took, then a line every few seconds with the step, loss, time elapsed and time
left, and ends with ``recall accuracy: <fraction>`` on held-out sequences and whether that
reached ``TARGET_ACCURACY`` (with what to try when it did not). The exit status is 0 when every
check passes and the accuracy reaches the target, else 1. It runs on CUDA when available (the
Triton kernels), else on the CPU (the operators' reference path). Training is deterministic for
a given seed, device and thread count.
"""

from __future__ import annotations

import argparse
import time

from sdm_ops._cli import TARGET_ACCURACY, HelpFormatter, add_training_options, positive_int


def _check(name: str, ok: bool, detail: str) -> bool:
    print(f"  [{'ok' if ok else 'FAILED'}] {name}: {detail}")
    return ok


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m sdm_ops.demo",
        description="Check sdm_ops' operators on a key-value storage example (product-key "
        "top-k addressing, the sparse delta memory recurrence, the WY solve; each "
        "against the float64 reference), then train a small model with "
        "SparseDeltaMemory layers on multi-query associative recall under "
        "torch.compile(fullgraph=True) and print its recall accuracy on held-out "
        "sequences. Progress: a line when compiling starts and ends, then a line "
        "every few seconds with the step, loss, time elapsed and time left. The "
        f"exit status is 0 when every check passes and the accuracy reaches "
        f"{TARGET_ACCURACY}, else 1.",
    )
    parser.add_argument(
        "--pairs",
        type=positive_int,
        default=256,
        help="key-value pairs the operator check writes and reads back (default 256)",
    )
    parser.add_argument(
        "--heads",
        type=positive_int,
        default=2,
        help="heads (independent banks of 4096 slots) of the operator check (default 2)",
    )
    add_training_options(parser)
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and malformed options end here, before torch loads

import torch

import sdm_ops
from sdm_ops import reference as ref
from sdm_ops.examples import mqar
from sdm_ops.reference._common import _chunked


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    mqar.set_threads(args)
    args.device = args.device or mqar.default_device()
    ok = check_operators(args)
    print(
        "training a 2-block model with SparseDeltaMemory layers on multi-query associative "
        f"recall ({mqar.MQARTask.num_pairs} key-value pairs drawn from "
        f"{mqar.MQARTask.num_keys} keys, then {mqar.MQARTask.num_queries} queries)"
    )
    acc = mqar.train_from_args(args)
    reached = mqar.report(acc, args)
    if not ok:
        print("the operator checks FAILED (see [FAILED] above): exit status 1")
    return 0 if ok and reached else 1


def check_operators(args) -> bool:
    """The operators on a key-value storage example, each checked against float64."""
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    B, H, D, n = 1, args.heads, 64, args.pairs
    factors, k = (64, 64), 4
    S = factors[0] * factors[1]
    path = "Triton kernels" if dev.type == "cuda" else "reference (CPU path of the operators)"
    print(
        f"sdm_ops demo on {dev} ({path}): {n} key-value pairs, {H} heads, "
        f"{S} slots per head, {k} slots per key"
    )
    t0 = time.perf_counter()
    ok = True

    # Address: each key scores the 64 + 64 sub-keys of two factors; exact top-4 of 4096 slots.
    keys = torch.randn(B, n, H, 32, generator=g)
    sub_keys = torch.randn(H, 32, sum(factors), generator=g)
    raw = torch.einsum("bnhd,hdf->bnhf", keys, sub_keys).to(dev)
    val, lin = sdm_ops.product_key_topk(raw, factors, k)
    val_r, lin_r = ref.product_key_topk_bruteforce(raw.cpu(), factors, k)
    exact = torch.equal(lin.cpu(), lin_r) and torch.equal(val.cpu(), val_r)
    ok &= _check(
        "product_key_topk",
        exact,
        f"{n * H} rows, exact top-{k} of {S} slots equal to the brute force",
    )
    weights = torch.softmax(val.float(), -1)
    weights = weights / weights.norm(dim=-1, keepdim=True)  # unit sparse keys

    # Write every pair (tokens 0..n-1), then read every key (tokens n..2n-1).
    T = 2 * n
    v = torch.zeros(B, T, H, D, device=dev)
    v[:, :n] = torch.randn(B, n, H, D, generator=g).to(dev)
    beta = torch.zeros(B, T, H, device=dev)
    beta[:, :n] = 1.0
    pad = torch.full_like(lin, -1)
    write_idx = torch.cat([lin, pad], 1)
    read_idx = torch.cat([pad, lin], 1)
    write_w = torch.cat([weights, torch.zeros_like(weights)], 1)
    read_w = torch.cat([torch.zeros_like(weights), weights], 1)
    bank = torch.zeros(H, S, D, device=dev)
    with torch.no_grad():
        out, new_bank = sdm_ops.sparse_delta_memory(
            v, beta, write_idx, write_w, read_idx, read_w, bank, output_final_state=True
        )
    args64 = [
        x.cpu().double() if x.is_floating_point() else x.cpu()
        for x in (v, beta, write_idx, write_w, read_idx, read_w, bank)
    ]
    out_r, bank_r = ref.sdm_chunked_reference(*args64, chunk_size=64)
    err = ((out.cpu().double() - out_r).abs().max() / out_r.abs().max()).item()
    err_b = ((new_bank.cpu().double() - bank_r).abs().max() / bank_r.abs().max()).item()
    ok &= _check(
        "sparse_delta_memory",
        max(err, err_b) <= 1e-5,
        f"T={T}, relative error {err:.1e} (out), {err_b:.1e} (bank) against float64",
    )

    # The WY solve of one chunk of this run, against float64.
    prep = ref.chunk_prepare_reference(
        write_idx.cpu(), write_w.cpu(), read_idx.cpu(), read_w.cpu(), None, S, 64
    )
    A, QK = prep.A.reshape(-1, 64, 64), prep.QK.reshape(-1, 64, 64)
    betas = _chunked(ref.to_streams(beta.cpu()), 64, 0)  # [chunks, 64]
    X, QX = sdm_ops.wy_solve(A.to(dev), betas.to(dev), QK.to(dev))
    X_r, QX_r = ref.wy_solve_reference(A.double(), betas.double(), QK.double())
    err_w = max(
        ((X.cpu().double() - X_r).abs().max() / X_r.abs().max()).item(),
        ((QX.cpu().double() - QX_r).abs().max() / QX_r.abs().max().clamp(min=1)).item(),
    )
    ok &= _check(
        "wy_solve",
        err_w <= 1e-5,
        f"{A.shape[0]} chunks of 64, relative error {err_w:.1e} against float64",
    )

    # Recall: the value read back for each key against the value stored.
    got, want = out[:, n:].float(), v[:, :n]
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).flatten()
    print(
        f"  recall: median cosine {cos.median().item():.3f}, "
        f"{(cos > 0.9).float().mean().item():.1%} of keys above 0.9 "
        f"(later writes to shared slots interfere with earlier ones)"
    )
    print(
        f"operators checked in {time.perf_counter() - t0:.1f} s: "
        f"{'all checks passed' if ok else 'CHECKS FAILED'}"
    )
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
