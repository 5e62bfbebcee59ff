"""Random-row gathers as phase 2 makes them, in 64-byte pieces or whole rows (PERF_NOTES 34).

Phase 2 gives each of a stream's four programs 16 columns of every row a chunk touches, so a
256-byte float32 row reaches the memory system as four 64-byte requests from four SMs. This
times the same gathers without the recurrence around them, at the reference workload's
geometry (64 streams, 64 chunks of 512 random rows a stream, a 1 GiB float32 bank): each
program walks the chunks in order, and a chunk's addresses wait for the previous chunk's
loads (a dependence through the data, as the bank's writes make one in phase 2).

- ``pieces``: 4 programs a stream, each the 16 columns of all 512 rows of a chunk ([512, 16]);
- ``rows``: 4 programs a stream, each whole rows of a quarter of the chunk's entries
  ([128, 64]): the same bytes in 256-byte requests;
- ``+rmw``: the first half of the entries also stored back (phase 2's writes);
- ``+ahead``: each chunk's gathers issued before the previous chunk's sums and stores, with
  no dependence between chunks (what phase 2 could reach if a chunk's gathers never waited
  for the previous chunk's writes: the overlap PERF_NOTES 11 and 33 propose).

It prints the time (median of 10) and the bytes moved per second for each, at 8 warps and at
4. Usage on a GPU machine: ``PYTHONPATH=. python scripts/gather_pieces.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sdm_ops.bench import _time_ms

STREAMS, CHUNKS, ENTRIES, S, D = 64, 64, 512, 65536, 64


@triton.jit
def _walk_kernel(bank, idx, out, S, CHUNKS, ENTRIES: tl.constexpr, D: tl.constexpr,
                 NE: tl.constexpr, BD: tl.constexpr, RMW: tl.constexpr, AHEAD: tl.constexpr):
    p = tl.program_id(0) // 4
    j = tl.program_id(0) % 4
    if BD == D:         # whole rows, a quarter of the entries
        e = j * NE + tl.arange(0, NE)
        cols = tl.arange(0, BD)
    else:               # 16 columns, every entry
        e = tl.arange(0, NE)
        cols = j * BD + tl.arange(0, BD)
    bank_p = bank + p.to(tl.int64) * S * D
    acc = tl.zeros((BD,), dtype=tl.float32)
    dep = 0
    if AHEAD:
        s = tl.load(idx + p * CHUNKS * ENTRIES + e)
        ptr = bank_p + s.to(tl.int64)[:, None] * D + cols[None, :]
        rows = tl.load(ptr)
    for n in range(0, CHUNKS):
        if AHEAD:   # the next chunk's rows in flight while this chunk's are summed and stored
            more = n + 1 < CHUNKS
            s = tl.load(idx + (p * CHUNKS + n + 1) * ENTRIES + e, mask=more, other=0)
            nptr = bank_p + s.to(tl.int64)[:, None] * D + cols[None, :]
            nrows = tl.load(nptr, mask=more, other=0.0)
        else:
            s = tl.load(idx + (p * CHUNKS + n) * ENTRIES + e) + dep
            ptr = bank_p + s.to(tl.int64)[:, None] * D + cols[None, :]
            rows = tl.load(ptr)
        part = tl.sum(rows, 0)
        acc += part
        dep = (tl.sum(part) > 3.0e38).to(tl.int32)
        if RMW:
            tl.store(ptr, rows * 0.5 + 1.0, mask=(e < ENTRIES // 2)[:, None])
        tl.debug_barrier()
        if AHEAD:
            rows = nrows
            ptr = nptr
    tl.store(out + tl.program_id(0) * BD + tl.arange(0, BD), acc)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    bank = torch.randn(STREAMS, S, D, device="cuda", generator=g)
    idx = torch.randint(0, S, (STREAMS, CHUNKS, ENTRIES), device="cuda", generator=g,
                        dtype=torch.int32)
    out = torch.empty(STREAMS * 4, D, device="cuda")
    print(f"{STREAMS} streams x {CHUNKS} chunks x {ENTRIES} random rows of {D} float32, "
          f"bank {bank.numel() * 4 / 2**30:.0f} GiB; 4 programs a stream")
    print(f"{'variant':<18}{'warps':>6}{'ms':>9}{'TB/s':>8}")
    for name, ne, bd in (("pieces", ENTRIES, 16), ("rows", ENTRIES // 4, D)):
        for rmw, ahead in ((False, False), (True, False), (False, True), (True, True)):
            for warps in (8, 4):
                def fn():
                    _walk_kernel[(STREAMS * 4,)](bank, idx, out, S, CHUNKS, ENTRIES=ENTRIES,
                                                D=D, NE=ne, BD=bd, RMW=rmw, AHEAD=ahead,
                                                num_warps=warps)
                ms = _time_ms(fn, reps=10)
                moved = STREAMS * CHUNKS * ENTRIES * D * 4 * (1.5 if rmw else 1.0)
                label = name + ("+rmw" if rmw else "") + ("+ahead" if ahead else "")
                print(f"{label:<18}{warps:>6}{ms:>9.3f}{moved / ms / 1e9:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
