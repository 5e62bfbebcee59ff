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
    # In place: the same without the bank's copy.
    assert bench.floor_bytes(a, in_place=True) == 1080 + d - 512
    # Forward+backward: also the output and bank gradients read (64 + 256), the float inputs'
    # gradients written (344 + d), both index tensors again (32), every entry's row again (256).
    assert bench.floor_bytes_fwd_bwd(a) == 1080 + d + 320 + 344 + d + 32 + 256


def test_shared_entries_counts_the_entries_that_meet_another_on_a_slot():
    # One stream, chunks of 2 tokens: tokens 0 and 1 name slots 5, 7 | 5 and 9, -1 | 3 (write |
    # read): the two entries on slot 5 share it; token 2 holds padding only (as does the pad
    # past T), which shares nothing however often it repeats.
    a = {"write_idx": torch.tensor([[5, 7], [9, -1], [-1, -1]]).view(1, 3, 1, 2),
         "read_idx": torch.tensor([[5], [3], [-1]]).view(1, 3, 1, 1)}
    shared, most = bench.shared_entries(a, 2)
    assert shared.tolist() == [[[2, 0]]] and most.tolist() == [[[2, 0]]]
    # Chunks of 4 tokens: one chunk, the same two entries.
    shared, most = bench.shared_entries(a, 4)
    assert shared.tolist() == [[[2]]] and most.tolist() == [[[2]]]
    # Three entries on slot 3 and two on slot 9 in one chunk: 5 shared, at most 3 on a slot.
    a["write_idx"][0, 2, 0] = torch.tensor([3, 9])
    a["read_idx"][0, 0, 0, 0] = 3
    shared, most = bench.shared_entries(a, 4)
    assert shared.tolist() == [[[5]]] and most.tolist() == [[[3]]]


def test_a_hot_workload_names_only_its_hot_slots():
    a = bench.make_workload(2, 64, 2, 16, 4096, 4, 4, decay=False, bank_dtype=torch.float32,
                            dev="cpu", hot=8)
    slots = torch.cat([a["write_idx"].flatten(), a["read_idx"].flatten()]).unique()
    assert len(slots) == 8 and slots.min() >= 0 and slots.max() < 4096
    # Without hot, the indices spread over the whole bank.
    b = bench.make_workload(2, 64, 2, 16, 4096, 4, 4, decay=False, bank_dtype=torch.float32,
                            dev="cpu")
    assert len(torch.cat([b["write_idx"].flatten(), b["read_idx"].flatten()]).unique()) > 8


def test_tables_only_without_a_table_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--tables-only"])
    assert exit_info.value.code == 2
    assert "--tables-only needs --addressing or --scaling" in capsys.readouterr().err
