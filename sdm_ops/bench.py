"""Benchmark of the SDM forward on the GPU: ``python -m sdm_ops.bench``.

Reference workload: B=8, T=4096, H=8, D=64, S=65536, W=R=8, bfloat16 values; float32 bank with
and without decay, and a bfloat16 bank. For each case it prints the forward time (median of
CUDA-event timings) eager and replayed from a CUDA graph, the CUDA operations (kernels and any
device copy) of one forward, the bytes-moved floor over the copy bandwidth measured in the same
run, the in-place forward (``sparse_delta_memory_``, which copies no bank) replayed with its own
floor, forward+backward time eager and replayed with its own floor and its peak memory above the
inputs, and the stock-PyTorch reference path on the GPU.
"""

from __future__ import annotations

import argparse
import gc

import torch

import sdm_ops
from sdm_ops import reference as ref


def _time_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    x = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _time_ms(lambda: y.copy_(x), reps=10)
    return 2 * x.numel() / (ms * 1e-3)


def kernel_launches(fn) -> int:
    """CUDA operations (kernels and device copies) one call of ``fn`` makes (after a warm-up
    call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def make_workload(B, T, H, D, S, W, R, *, decay: bool, bank_dtype, seed: int = 0,
                  dev: str = "cuda", hot: int | None = None):
    """Random inputs of the recurrence; every index uniform over the S slots, or with ``hot``
    over a fixed random set of ``hot`` of them (addressing that favours some slots, as a
    trained model's may)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    slots = None if hot is None else torch.randperm(S, device=dev, generator=g)[:hot]

    def idx(*shape):
        if slots is None:
            return torch.randint(0, S, shape, device=dev, generator=g)
        return slots[torch.randint(0, hot, shape, device=dev, generator=g)]
    args = dict(
        v=torch.randn(B, T, H, D, device=dev, generator=g).to(torch.bfloat16),
        beta=torch.rand(B, T, H, device=dev, generator=g),
        write_idx=idx(B, T, H, W),
        write_w=torch.rand(B, T, H, W, device=dev, generator=g) / W ** 0.5,
        read_idx=idx(B, T, H, R),
        read_w=torch.rand(B, T, H, R, device=dev, generator=g) / R ** 0.5,
        bank=(torch.randn(B, H, S, D, device=dev, generator=g) * 0.1).to(bank_dtype),
    )
    if decay:
        args["decay"] = 0.9 + 0.1 * torch.rand(B, T, H, W, device=dev, generator=g)
    return args


def floor_bytes(a: dict, in_place: bool = False) -> int:
    """Bytes a forward without autograd must move at least: its inputs once, out, the returned
    bank (read and written; not with ``in_place``, which updates the bank it is given), each
    entry's bank row gathered once and each written row written once (it keeps no
    snapshot)."""
    B, T, H, D = a["v"].shape
    W, R = a["write_idx"].shape[-1], a["read_idx"].shape[-1]
    bank = a["bank"]
    row = D * bank.element_size()
    inputs = (sum(t.numel() * t.element_size() for t in a.values())
              - bank.numel() * bank.element_size())
    out = a["v"].numel() * a["v"].element_size()
    entries = B * T * H
    copy = 0 if in_place else 2 * bank.numel() * bank.element_size()
    return inputs + out + copy + entries * (W + R) * row + entries * W * row


def floor_bytes_fwd_bwd(a: dict) -> int:
    """Bytes a forward+backward must move at least: the forward's floor (``floor_bytes``), the
    output and bank gradients read, a gradient of every float input written (its size and
    dtype), the indices read again and each entry's bank row read again (the backward needs
    every entry's row as it was at its chunk's start, from a snapshot or recomputed)."""
    B, T, H, D = a["v"].shape
    W, R = a["write_idx"].shape[-1], a["read_idx"].shape[-1]
    bank = a["bank"]
    size = lambda t: t.numel() * t.element_size()   # noqa: E731
    grads_in = size(a["v"]) + size(bank)
    grads_out = sum(size(a[k]) for k in FLOATS if k in a)
    indices = size(a["write_idx"]) + size(a["read_idx"])
    return (floor_bytes(a) + grads_in + grads_out + indices
            + B * T * H * (W + R) * D * bank.element_size())


FLOATS = ("v", "beta", "write_w", "read_w", "bank", "decay")


def forward_fn(a: dict, chunk_size: int, **kw):
    """A call of the forward of ``sparse_delta_memory`` on ``a``, without autograd."""
    def fwd():
        with torch.no_grad():
            return sdm_ops.sparse_delta_memory(**a, chunk_size=chunk_size, **kw)
    return fwd


def in_place_fn(a: dict, chunk_size: int):
    """A call of ``sparse_delta_memory_`` on ``a``: the inference forward, which updates a bank
    in place and copies nothing (its own copy of ``a``'s bank, made once and updated by every
    call; the time does not depend on the values)."""
    bank = a["bank"].clone()
    rest = {k: t for k, t in a.items() if k != "bank"}
    return lambda: sdm_ops.sparse_delta_memory_(bank=bank, **rest, chunk_size=chunk_size)


def forward_backward_fn(a: dict, chunk_size: int, **kw):
    """A call of the forward and backward of ``sparse_delta_memory`` on ``a``: the gradients of
    every float input (its own leaves, made once) for output and bank gradients of ones (made
    once too, outside the call, as a downstream loss would hand them over). The gradients are
    returned, not accumulated into ``.grad``, so the call times the operator alone."""
    leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if k in a}
    B, H = a["v"].shape[0], a["v"].shape[2]
    bank = a["bank"]
    cu_seqlens = kw.get("cu_seqlens")
    banks = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    g_out = torch.ones_like(a["v"])
    g_bank = torch.ones((banks, H) + tuple(bank.shape[-2:]), dtype=bank.dtype, device=bank.device)

    def fwd_bwd():
        out, bank = sdm_ops.sparse_delta_memory(**dict(a, **leaves), chunk_size=chunk_size, **kw)
        return torch.autograd.grad((out, bank), list(leaves.values()), (g_out, g_bank))
    return fwd_bwd


def snapshot_errors(a: dict, chunk_size: int) -> None:
    """Print, per snapshot mode, the bytes kept per token and the error of each gradient
    against the exact mode ("none"): max |g - g_none| / max |g_none|."""
    names = [k for k in FLOATS if k in a]
    B, T, H, D = a["v"].shape
    W, R = a["write_idx"].shape[-1], a["read_idx"].shape[-1]
    grads = {}
    for mode in ("none", "bf16", "fp8", "int4"):
        leaves = {k: a[k].detach().clone().requires_grad_() for k in names}
        out, bank = sdm_ops.sparse_delta_memory(**dict(a, **leaves), chunk_size=chunk_size,
                                                snapshot=mode)
        g = torch.Generator(device=out.device).manual_seed(1)
        g_out = torch.randn(out.shape, device=out.device, generator=g)
        g_bank = torch.randn(bank.shape, device=bank.device, generator=g)
        loss = (out.float() * g_out).sum() + (bank.float() * g_bank).sum()
        grads[mode] = torch.autograd.grad(loss, [leaves[k] for k in names])
    row = {"none": D * a["bank"].element_size(), "bf16": D * 2, "fp8": D + D // 4,
           "int4": D // 2 + D // 4}
    print(f"snapshot modes, B={B} T={T} H={H} D={D} W={W} R={R}: bytes kept per token and the "
          "gradients' error against 'none'")
    print(f"{'mode':<6}{'bytes/token':>12}" + "".join(f"{'d' + n:>10}" for n in names))
    for mode, gs in grads.items():
        errs = [((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                for x, y in zip(gs, grads["none"])]
        print(f"{mode:<6}{row[mode] * (W + R):>12d}" + "".join(f"{e:>10.1e}" for e in errs))


def packed_workload(B, T, H, D, S, W, R) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(workload, cu_seqlens on the GPU, lengths on the CPU) of B sequences of mixed lengths
    packed into one [1, B * T / 2] batch (lengths from T / 8 to T), float32 bank with decay,
    one bank per sequence."""
    lengths = torch.linspace(T // 8, T, B).round().long()
    lengths = (lengths * (B * T // 2) / lengths.sum()).long().clamp(1, T)
    packed = make_workload(1, int(lengths.sum()), H, D, S, W, R, decay=True,
                           bank_dtype=torch.float32)
    packed["bank"] = packed["bank"].expand(B, -1, -1, -1).contiguous()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to("cuda")
    return packed, cu, lengths


def packed_vs_padded(B, T, H, D, S, W, R, chunk_size: int) -> None:
    """A packed batch (``packed_workload``) against the same sequences padded to [B, T]
    (padding: index -1, weight 0): forward and forward+backward times, float32 bank with
    decay."""
    packed, cu, lengths = packed_workload(B, T, H, D, S, W, R)
    total = int(lengths.sum())
    padded = make_workload(B, T, H, D, S, W, R, decay=True, bank_dtype=torch.float32)
    pad = torch.arange(T, device="cuda")[None, :] >= lengths.to("cuda")[:, None]   # [B, T]
    for k in ("write_idx", "read_idx"):
        padded[k] = padded[k].masked_fill(pad[:, :, None, None], -1)
    rows = []
    for name, a, kw in (("packed (cu_seqlens)", packed, {"cu_seqlens": cu}),
                        ("padded to [B, T]", padded, {})):
        rows.append((name, _time_ms(forward_fn(a, chunk_size, **kw)),
                     _time_ms(forward_backward_fn(a, chunk_size, **kw), reps=5, warmup=2)))
    print(f"packed vs padded: {B} sequences of {int(lengths.min())} to {int(lengths.max())} "
          f"tokens ({total} in all, {B * T} padded), H={H} D={D} S={S} W={W} R={R} "
          f"C={chunk_size}, float32 bank, decay")
    print(f"{'batch':<22}{'fwd ms':>9}{'fwd+bwd ms':>12}")
    for name, ms, bwd_ms in rows:
        print(f"{name:<22}{ms:>9.3f}{bwd_ms:>12.3f}")


def fwd_bwd_ms(a: dict, chunk_size: int, snapshot: str = "none", reps: int = 5) -> float:
    """Forward+backward time of ``sparse_delta_memory`` on ``a`` (gradients of every float)."""
    return _time_ms(forward_backward_fn(a, chunk_size, snapshot=snapshot), reps=reps, warmup=2)


def kernel_times(fn, top: int = 12) -> list[tuple[str, float, int]]:
    """(kernel name, total CUDA ms, calls) of one call of ``fn`` (after a warm-up call), the
    ``top`` longest first: where the time of a forward or forward+backward goes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(e.name, [0.0, 0])
            entry[0] += e.device_time_total / 1e3
            entry[1] += 1
    rows = sorted(((n, t, c) for n, (t, c) in totals.items()), key=lambda r: -r[1])
    return rows[:top]


def _captured(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of ``fn``, after two warm-up calls (Triton compilation, the
    allocator) on a side stream, as ``torch.cuda.graph`` requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def decode_step_us(B, H, D, S, W, R, *, bank_dtype) -> float:
    """One decode step (T = 1, every stream) of ``sparse_delta_memory_`` replayed from a CUDA
    graph: microseconds per replay, over 200 replays."""
    a = make_workload(B, 1, H, D, S, W, R, decay=True, bank_dtype=bank_dtype)
    bank = a.pop("bank")
    graph = _captured(lambda: sdm_ops.sparse_delta_memory_(bank=bank, **a))
    n = 200
    return _time_ms(lambda: [graph.replay() for _ in range(n)], reps=5, warmup=1) * 1e3 / n


def replay_ms(fn) -> float:
    """One call of ``fn`` replayed from a CUDA graph: milliseconds per replay. No host work
    between the kernels (our eager checks, which read data, are skipped while capturing), so
    against the eager call it shows what the host costs; the graph's memory is freed after."""
    graph = _captured(fn)
    ms = _time_ms(graph.replay)
    del graph
    torch.cuda.empty_cache()
    return ms


def _import_peer(module: str, name: str):
    """(function, None), or (None, why) when it cannot be imported."""
    try:
        return getattr(__import__(module, fromlist=[name]), name), None
    except Exception as e:          # noqa: BLE001 - a broken optional install is reported
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return None, f"{type(e).__name__}: {first}"


def fla_peers(B, T, H, D) -> tuple[list[tuple], list[tuple[str, str]]]:
    """fla-core's chunk_delta_rule and chunk_kda at the same B, T, H and K = V = D, bfloat16:
    rows (name, forward ms, its graph replay ms, forward+backward ms, its graph replay ms) for
    those that import, and (name, why) for those that do not (fla-core not installed, or an
    import error of its own)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g)   # noqa: E731
    q, k, v = (rnd(B, T, H, D).to(torch.bfloat16) for _ in range(3))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(torch.bfloat16)
    gate = -torch.rand(B, T, H, D, device="cuda", generator=g) * 0.1
    rows, missing = [], []
    for name, module, attr, extra in (
            ("fla chunk_delta_rule", "fla.ops.delta_rule", "chunk_delta_rule", ()),
            ("fla chunk_kda", "fla.ops.kda", "chunk_kda", (gate,))):
        fn, why = _import_peer(module, attr)
        if fn is None:
            missing.append((name, why))
            continue

        def fwd():
            with torch.no_grad():
                return fn(q, k, v, *extra, beta)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        g_o = torch.ones_like(v)

        def fwd_bwd():
            return torch.autograd.grad(fn(*leaves, *extra, beta)[0], leaves, g_o)
        rows.append((name, _time_ms(fwd), replay_ms(fwd), _time_ms(fwd_bwd, reps=5, warmup=2),
                     replay_ms(fwd_bwd)))
    return rows, missing


def shared_entries(a: dict, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk ([B, H, N] each): how many of its entries (write and read, padding aside)
    name a slot that another entry of the chunk names too (the entries phase 1 must pair), and
    the most entries on one slot. A chunk with more than ``chunk_prepare.COMPACT`` entries in
    one hash bucket (on one slot, unless two slots share a hash) takes phase 1's dense
    kernels."""
    idx = torch.cat([a["write_idx"], a["read_idx"]], dim=-1)         # [B, T, H, E]
    B, T, H, E = idx.shape
    C = chunk_size
    N = -(-T // C)
    idx = torch.nn.functional.pad(idx, (0, 0, 0, 0, 0, N * C - T), value=-1)
    idx = idx.view(B, N, C, H, E).permute(0, 3, 1, 2, 4).reshape(B, H, N, C * E)
    s = idx.sort(dim=-1).values
    dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
    shared = torch.zeros_like(s, dtype=torch.bool)
    shared[..., 1:] |= dup
    shared[..., :-1] |= dup
    # An entry's place in its run of equal slots: its index less the index of the run's start.
    at = torch.arange(s.shape[-1], device=s.device).expand_as(s)
    start = torch.where(torch.nn.functional.pad(dup, (1, 0), value=False), 0, at)
    run = at - start.cummax(-1).values + 1
    return shared.sum(-1), torch.where(s >= 0, run, 0).amax(-1)


def addressing(shape, reps: int = 3) -> None:
    """Forward and forward+backward as a chunk's entries share more slots: chunk sizes 32 to
    128 over the whole bank, and chunk 64 over hot sets of S / 16 and S / 256 slots (float32
    bank, decay), with the share of chunks that overflow phase 1's sparse path; each eager and
    replayed from a CUDA graph."""
    from .kernels.chunk_prepare import COMPACT
    B, T, H, D, S, W, R = shape
    print(f"addressing: float32 bank, decay; indices uniform over a hot set of slots; a chunk "
          f"with more than {COMPACT} entries on one slot runs phase 1's dense kernels")
    print(f"{'hot slots':>10}{'chunk':>6}{'shared/chunk':>13}{'dense chunks':>13}"
          f"{'fwd ms':>9}{'graph':>7}{'fwd+bwd ms':>12}{'graph':>7}")
    for hot, C in ((S, 32), (S, 64), (S, 128), (S // 16, 64), (S // 256, 64)):
        a = make_workload(*shape, decay=True, bank_dtype=torch.float32, hot=hot)
        count, most = shared_entries(a, C)
        dense = (most > COMPACT).float().mean().item()
        fwd, fwd_bwd = forward_fn(a, C), forward_backward_fn(a, C)
        ms = _time_ms(fwd, reps=reps, warmup=1)
        bwd_ms = _time_ms(fwd_bwd, reps=reps, warmup=1)
        print(f"{hot:>10}{C:>6}{count.float().mean().item():>13.1f}{dense:>13.1%}{ms:>9.3f}"
              f"{replay_ms(fwd):>7.3f}{bwd_ms:>12.3f}{replay_ms(fwd_bwd):>7.3f}", flush=True)
        del fwd_bwd, a
        torch.cuda.empty_cache()


def scaling(args) -> None:
    """Forward and forward+backward over T, S and D (B = 1, H = 8, float32 bank, decay), each
    eager and replayed from a CUDA graph (at B = 1 an eager call can be mostly host time), and
    the in-place forward replayed (the functional calls copy the bank, whose size grows with S
    and D; the in-place one does not)."""
    print(f"scaling: B=1 H=8 W=8 R=8 C={args.chunk_size}, float32 bank, decay")
    print(f"{'T':>6}{'S':>9}{'D':>5}{'fwd ms':>9}{'graph':>7}{'in place':>9}{'fwd+bwd ms':>12}"
          f"{'graph':>7}")
    for D in (64, 128):
        for S in (2 ** 16, 2 ** 20):
            for T in (1024, 4096, 16384):
                a = make_workload(1, T, 8, D, S, 8, 8, decay=True, bank_dtype=torch.float32)
                C = args.chunk_size
                fwd, fwd_bwd = forward_fn(a, C), forward_backward_fn(a, C)
                ms = _time_ms(fwd, reps=5, warmup=1)
                bwd_ms = _time_ms(fwd_bwd, reps=3, warmup=2)
                print(f"{T:>6}{S:>9}{D:>5}{ms:>9.3f}{replay_ms(fwd):>7.3f}"
                      f"{replay_ms(in_place_fn(a, C)):>9.3f}{bwd_ms:>12.3f}"
                      f"{replay_ms(fwd_bwd):>7.3f}", flush=True)
                del fwd_bwd, a
                torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="SDM forward benchmark")
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--H", type=int, default=8)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--S", type=int, default=65536)
    parser.add_argument("--W", type=int, default=8)
    parser.add_argument("--R", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference")
    parser.add_argument("--snapshot-errors", action="store_true",
                        help="only measure the snapshot modes' gradient error (CPU or CUDA)")
    parser.add_argument("--no-packed", action="store_true",
                        help="skip the packed-versus-padded (cu_seqlens) comparison")
    parser.add_argument("--scaling", action="store_true",
                        help="also print the scaling table over T, S and D")
    parser.add_argument("--addressing", action="store_true",
                        help="also print the table over chunk sizes and hot slot sets")
    parser.add_argument("--tables-only", action="store_true",
                        help="print only the tables --addressing and --scaling ask for (each of"
                             " them and the main table with its peers take minutes)")
    parser.add_argument("--profile", action="store_true",
                        help="only print where forward+backward time goes, kernel by kernel")
    args = parser.parse_args(argv)
    if args.tables_only and not (args.addressing or args.scaling):
        parser.error("--tables-only needs --addressing or --scaling: it prints only those tables")
    shape = (args.B, args.T, args.H, args.D, args.S, args.W, args.R)
    if args.snapshot_errors:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        snapshot_errors(make_workload(*shape, decay=True, bank_dtype=torch.float32, dev=dev),
                        args.chunk_size)
        return 0
    if not torch.cuda.is_available():
        print("sdm_ops.bench needs a CUDA GPU; nothing to measure here.")
        return 0
    if args.profile:
        a = make_workload(*shape, decay=True, bank_dtype=torch.float32)
        print("forward+backward, float32 bank, decay: CUDA time by kernel")
        for name, ms, calls in kernel_times(forward_backward_fn(a, args.chunk_size)):
            print(f"{ms:>9.3f} ms {calls:>4d}x  {name[:90]}")
        return 0
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, copy bandwidth "
          f"{bw / 1e12:.2f} TB/s")
    print(f"B={args.B} T={args.T} H={args.H} D={args.D} S={args.S} W={args.W} R={args.R} "
          f"C={args.chunk_size}, bfloat16 values")
    if args.tables_only:
        if args.addressing:
            addressing(shape)
        if args.scaling:
            scaling(args)
        return 0
    head = (f"{'case':<28}{'fwd ms':>8}{'graph':>7}{'launches':>9}{'floor ms':>9}"
            f"{'x floor':>8}{'in place':>9}{'floor ms':>9}{'x floor':>8}"
            f"{'fwd+bwd ms':>11}{'graph':>7}{'floor ms':>9}{'x floor':>8}"
            f"{'peak GiB':>9}"
            f"{'reference fwd ms':>17}")
    print(head)
    print("-" * len(head))
    cases = [("float32 bank, decay", True, torch.float32),
             ("float32 bank, no decay", False, torch.float32),
             ("bfloat16 bank, decay", True, torch.bfloat16)]
    for name, decay, bank_dtype in cases:
        a = make_workload(*shape, decay=decay, bank_dtype=bank_dtype)

        fwd = forward_fn(a, args.chunk_size)
        ms = _time_ms(fwd)
        graph_ms = replay_ms(fwd)
        launches = kernel_launches(fwd)
        in_place_ms = replay_ms(in_place_fn(a, args.chunk_size))
        in_place_floor = floor_bytes(a, in_place=True) / bw * 1e3
        fwd_bwd = forward_backward_fn(a, args.chunk_size)
        bwd_ms = _time_ms(fwd_bwd, reps=5, warmup=2)
        # Nothing allocated before may be freed inside the measured call (a collected CUDA
        # graph's pool, say), or the peak above the base reads low.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        bwd_graph_ms = replay_ms(fwd_bwd)
        del fwd_bwd
        floor = floor_bytes(a) / bw * 1e3
        bwd_floor = floor_bytes_fwd_bwd(a) / bw * 1e3
        ref_ms = float("nan")
        if not args.no_reference:
            def ref_fwd(a=a):
                with torch.no_grad():
                    return ref.sdm_chunked_reference(**a, chunk_size=args.chunk_size)
            ref_ms = _time_ms(ref_fwd, reps=2, warmup=1)
        print(f"{name:<28}{ms:>8.3f}{graph_ms:>7.3f}{launches:>9d}{floor:>9.3f}{ms / floor:>8.2f}"
              f"{in_place_ms:>9.3f}{in_place_floor:>9.3f}{in_place_ms / in_place_floor:>8.2f}"
              f"{bwd_ms:>11.3f}{bwd_graph_ms:>7.3f}{bwd_floor:>9.3f}{bwd_ms / bwd_floor:>8.2f}"
              f"{peak:>9.2f}"
              f"{ref_ms:>17.1f}")
        del a
        torch.cuda.empty_cache()
    B, T, H, D, S, W, R = shape
    print("snapshot modes, float32 bank, decay: forward+backward ms")
    a = make_workload(*shape, decay=True, bank_dtype=torch.float32)
    print("  ".join(f"{mode} {fwd_bwd_ms(a, args.chunk_size, mode):.3f}"
                    for mode in ("none", "bf16", "fp8", "int4")))
    del a
    torch.cuda.empty_cache()
    print(f"decode step (T=1, B*H={B * H} streams, CUDA graph replay): "
          f"float32 bank {decode_step_us(B, H, D, S, W, R, bank_dtype=torch.float32):.1f} us, "
          f"bfloat16 bank {decode_step_us(B, H, D, S, W, R, bank_dtype=torch.bfloat16):.1f} us")
    peers, missing = fla_peers(B, T, H, D)
    if peers:
        print(f"peers at B={B} T={T} H={H} K=V={D}, bfloat16 (state {D}x{D} per stream, "
              f"{S // D} times smaller than the bank)")
        for name, ms, graph_ms, bwd_ms, bwd_graph_ms in peers:
            print(f"{name:<28}{ms:>8.3f}{graph_ms:>7.3f}{'':>52}{bwd_ms:>11.3f}"
                  f"{bwd_graph_ms:>7.3f}")
    for name, why in missing:
        print(f"peer {name} skipped: {why} (pip install fla-core)")
    if not args.no_packed:
        packed_vs_padded(*shape, args.chunk_size)
    if args.addressing:
        addressing(shape)
    if args.scaling:
        scaling(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
