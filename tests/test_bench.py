"""The benchmark's bytes floors, counted by hand for a tiny workload (the GPU timings themselves
are not tested: they are the benchmark's output)."""

import pytest
import torch

from sdm_ops import bench


@pytest.mark.parametrize("decay", [False, True])
def test_floors_count_every_tensor_once(decay):
    # B=1, T=2, H=1, D=16, S=4, W=R=1: v bfloat16 64 B, beta 8, write_idx / read_idx int64 16
    # each, write_w / read_w 8 each, decay 8, float32 bank 256, a bank row 64.
    a = bench.make_workload(1, 2, 1, 16, 4, 1, 1, decay=decay, bank_dtype=torch.float32,
                            dev="cpu")
    d = 8 if decay else 0
    # Forward: inputs but the bank 120 + d, out 64, bank read and written 512, 2 tokens x 2
    # entries gathered 256, 2 written rows 128.
    assert bench.floor_bytes(a) == 1080 + d
    # Forward+backward: also the output and bank gradients read (64 + 256), the float inputs'
    # gradients written (344 + d), both index tensors again (32), every entry's row again (256).
    assert bench.floor_bytes_fwd_bwd(a) == 1080 + d + 320 + 344 + d + 32 + 256
