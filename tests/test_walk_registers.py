"""Phase 2's walks keep their register budget on the GPU's own compiler (Triton 3.6 for sm_90a,
without a GPU: ``tools/ptxas_report.py``), so that no change adds a wave or spills silently.

A walk launches B * H * D / 16 programs of 8 warps (256 at the reference workload, on 132
SMs): at 128 registers or fewer two programs fit an SM and every program runs in one wave; above
it, one. The in-place walk fits 128 as it is; the other forward walks but the training walk
over a float32 bank run capped at 128 (``recurrence_fwd.walk_capped``); each is held there
with the bytes it spills now. The others (that walk, the backward, ``_out_kernel`` and the
backward's ``_qx_dout_kernel`` and dual matmul) are held to what they use now, an upper bound
a change may lower (then lower the pin) but not raise.

The budgets are those of Triton 3.6, the Triton of the GPU the project measures on; another
Triton allocates registers differently. The test compiles with the Triton installed in the
folder ``SDM_GPU_TRITON`` names (``pip install --target DIR --no-deps triton==3.6.0``, as
``.ci/run`` does), and skips without it."""

from __future__ import annotations

import os

import pytest

from sdm_ops.kernels.recurrence_fwd import ONE_WAVE_REGS as ONE_WAVE

# (registers, spilled bytes) a thread at most, per walk variant, at the reference
# configuration (W = R = 8, D = 64, chunk 64).
BUDGETS = {
    "_dual_matmul_bwd_kernel": (232, 0),
    "_out_kernel": (165, 0),
    "_qx_dout_kernel": (94, 0),
    "bwd MODE=0 snap=*bf16": (225, 0),
    "bwd MODE=0 snap=*fp32": (251, 0),
    "bwd MODE=1 snap=*bf16": (225, 0),
    "bwd MODE=2 snap=*u8": (255, 0),
    "bwd MODE=3 snap=*u8": (236, 0),
    # The in-place walk (sparse_delta_memory_, and the inference forward with the final state),
    # within one wave uncapped.
    "fwd SNAPSHOT=False SOURCE=False ROWS=False bank=*bf16": (ONE_WAVE, 0),
    "fwd SNAPSHOT=False SOURCE=False ROWS=False bank=*fp32": (ONE_WAVE, 4),
    # The walks below from a source bank, capped where their programs outnumber the SMs
    # (recurrence_fwd.walk_capped).
    # The inference forward without the final state, on the slots or on a working set: capped,
    # a few bytes spilled.
    "fwd SNAPSHOT=False SOURCE=True ROWS=False bank=*bf16": (ONE_WAVE, 4),
    "fwd SNAPSHOT=False SOURCE=True ROWS=False bank=*fp32": (ONE_WAVE, 12),
    "fwd SNAPSHOT=False SOURCE=True ROWS=True bank=*bf16": (ONE_WAVE, 20),
    "fwd SNAPSHOT=False SOURCE=True ROWS=True bank=*fp32": (ONE_WAVE, 28),
    # The training forward, every snapshot mode (MODE), with and without a working set: over a
    # bfloat16 bank capped (out after the walk), over a float32 one not (it would spill 48 to
    # 220 bytes), forming out itself.
    **{
        f"fwd SNAPSHOT=True MODE={m} SOURCE=True ROWS={rows} bank=*bf16": (ONE_WAVE, 0)
        for m in range(3)
        for rows in (False, True)
    },
    "fwd SNAPSHOT=True MODE=3 SOURCE=True ROWS=False bank=*bf16": (ONE_WAVE, 8),
    "fwd SNAPSHOT=True MODE=3 SOURCE=True ROWS=True bank=*bf16": (ONE_WAVE, 48),
    **{
        f"fwd SNAPSHOT=True MODE={m} SOURCE=True ROWS={rows} bank=*fp32": (255, 0)
        for m in range(4)
        for rows in (False, True)
    },
}


def _variant(row: dict) -> str | None:
    c, t = row["consts"], row["types"]
    if row["name"] == "_recurrence_fwd_kernel":
        mode = f" MODE={c['MODE']}" if c["SNAPSHOT"] else ""
        return (
            f"fwd SNAPSHOT={c['SNAPSHOT']}{mode} SOURCE={c['SOURCE']} ROWS={c['ROWS']} "
            f"bank={t['bank']}"
        )
    if row["name"] == "_recurrence_bwd_kernel":
        return f"bwd MODE={c['MODE']} snap={t['snap']}"
    if row["name"] in ("_out_kernel", "_qx_dout_kernel", "_dual_matmul_bwd_kernel"):
        return row["name"]
    return None


@pytest.mark.skipif(
    not os.environ.get("SDM_GPU_TRITON"),
    reason="needs SDM_GPU_TRITON: a folder holding the GPU's Triton (pip install --target)",
)
def test_every_walk_variant_stays_within_its_register_budget():
    from tools import ptxas_report

    rows = ptxas_report.registers(
        ptxas_report._launches(64), os.path.abspath(os.environ["SDM_GPU_TRITON"])
    )
    seen, over = set(), []
    for row in rows:
        name = _variant(row)
        if name is None:
            continue
        seen.add(name)
        budget = BUDGETS.get(name)
        assert budget is not None, f"a walk variant without a budget: {name} ({row})"
        if row["regs"] > budget[0] or row["spill"] > budget[1]:
            over.append(f"{name}: {row['regs']} registers, {row['spill']} B spilled > {budget}")
    assert not over, "walks over their register budget:\n" + "\n".join(over)
    assert seen == set(BUDGETS), f"budgets of variants never launched: {set(BUDGETS) - seen}"
