"""Phase 2 alone (the in-place forward kernel, and the backward kernel) at the reference
workload's shape over bank sizes S: whether its time follows DRAM (a bank far larger than L2)
or stays when every stream's rows fit in L2.

For each S, phase 1 and the WY solve run once; then ``ops.recurrence_fwd_`` (phase 2 in place,
no snapshot) and the backward's launcher (``kernels.recurrence_bwd``: phase 2's backward from a
float32 snapshot, then the dual-matmul kernel and the partials' sums, about 0.2 ms; no bank
copy) are timed alone, median of 20 CUDA-event timings, eagerly (the host's work before a
launch counts while the GPU waits for it) and replayed from a CUDA graph (the kernels alone);
the backward adds into the same dM every call. The bank rows they move (each entry's row
gathered, each written row written; the backward's snapshot rows and dM rows the same way) are
printed over the replayed time. (Its first run, at b8fc2c7, timed eagerly only: PERF_NOTES 38.)
At S = 4096 a stream's float32 bank is 1 MiB, and at most 33 streams run at once (132 programs
of 4 column blocks, one an SM): 33 MiB of bank, within the H200's 50 MiB L2; at S = 65536 it is
16 MiB a stream. A small S also puts more of a chunk's entries on one slot (more passes).
Usage on a GPU machine: ``PYTHONPATH=. python scripts/phase2_by_bank.py``.
"""

from __future__ import annotations

import torch

from profile_phase2 import phase2_inputs

from sdm_ops import bench, ops
from sdm_ops.kernels import recurrence_bwd as kb


def main() -> None:
    B, T, H, D, W, R, C = 8, 4096, 8, 64, 8, 8, 64
    print(f"phase 2 alone, B,T,H,D,W,R = {B},{T},{H},{D},{W},{R}, chunk {C}, float32 bank, "
          "decay (ms, median of 20; GB/s of bank rows over the graph's time)")
    for S in (4096, 16384, 65536, 1 << 18):
        a = bench.make_workload(B, T, H, D, S, W, R, decay=True, bank_dtype=torch.float32)
        fwd_in, dout, dbank = phase2_inputs(a, C, "none")
        _, _, _, _, gw, gr, sw, rd, rank, read_rank, X, QX = fwd_in[:12]
        work = a["bank"].clone()
        fwd_ = lambda: ops.recurrence_fwd_(work, *fwd_in[:9], *fwd_in[10:12])
        out, _, snap, scale, res, delta = ops.recurrence_fwd(*fwd_in)
        dv, dX, dQX = torch.empty_like(a["v"]), torch.empty_like(X), torch.empty_like(QX)
        dbeta = torch.empty_like(a["beta"], dtype=torch.float32)
        bwd = lambda: kb.recurrence_bwd(a["beta"], a["write_idx"], a["read_idx"], gw, gr, sw, rd,
                                        rank, read_rank, X, QX, res, delta, snap, scale, "none",
                                        dout, dbank, dv, dX, dQX, dbeta)
        row = D * 4
        entries = B * T * H
        fwd_bytes = entries * (W + R + W) * row        # gathers, then the written rows
        passes = int(rank.max()) + 1
        ms_f, graph_f = bench._time_ms(fwd_), bench.replay_ms(fwd_)
        ms_b, graph_b = bench._time_ms(bwd), bench.replay_ms(bwd)
        # The backward: snapshot rows read (W + R an entry), dM gathered and written at the
        # write slots, dM read-modify-written at the read slots.
        bwd_bytes = entries * ((W + R) + 2 * W + 2 * R) * row
        print(f"S {S:>8}  passes {passes}  in-place forward {ms_f:.3f} ms eager, "
              f"{graph_f:.3f} graph ({fwd_bytes / graph_f / 1e6:.0f} GB/s)  backward "
              f"{ms_b:.3f} eager, {graph_b:.3f} graph ({bwd_bytes / graph_b / 1e6:.0f} GB/s)",
              flush=True)


if __name__ == "__main__":
    main()
