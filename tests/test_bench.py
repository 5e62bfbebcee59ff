"""The benchmark's bytes floors, counted by hand for a tiny workload, and its command line (the
GPU timings themselves are not tested: they are the benchmark's output)."""

import json
import os

import pytest
import torch

from benchmarks import bench
from tests.helpers import run_module


@pytest.mark.parametrize("decay", [False, True])
def test_floors_count_every_tensor_once(decay):
    # B=1, T=2, H=1, D=16, S=4, W=R=1: v bfloat16 64 B, beta 8, write_idx / read_idx int64 16
    # each, write_w / read_w 8 each, decay 8, float32 bank 256, a bank row 64.
    a = bench.make_workload(1, 2, 1, 16, 4, 1, 1, decay=decay, bank_dtype=torch.float32, dev="cpu")
    d = 8 if decay else 0
    # Forward returning the final bank: inputs but the bank 120 + d, out 64, bank read and
    # written 512, 2 tokens x 2 entries gathered 256, 2 written rows 128.
    assert bench.floor_bytes(a, final=True) == 1080 + d
    # Without the final bank (the default), and in place: the same without the bank's copy.
    assert bench.floor_bytes(a) == 1080 + d - 512
    assert bench.floor_bytes(a, in_place=True) == 1080 + d - 512
    assert bench.floor_bytes(a, in_place=True, final=True) == 1080 + d - 512
    # Forward+backward: also the output and final bank gradients read (64 + 256), the float
    # inputs' gradients written (344 + d), both index tensors again (32), every entry's row
    # again (256); without the final bank, neither it nor its gradient.
    assert bench.floor_bytes_fwd_bwd(a, final=True) == 1080 + d + 320 + 344 + d + 32 + 256
    assert bench.floor_bytes_fwd_bwd(a) == 1080 + d - 512 + 64 + 344 + d + 32 + 256


def test_shared_entries_counts_the_entries_that_meet_another_on_a_slot():
    # One stream, chunks of 2 tokens: tokens 0 and 1 name slots 5, 7 | 5 and 9, -1 | 3 (write |
    # read): the two entries on slot 5 share it; token 2 holds padding only (as does the pad
    # past T), which shares nothing however often it repeats.
    a = {
        "write_idx": torch.tensor([[5, 7], [9, -1], [-1, -1]]).view(1, 3, 1, 2),
        "read_idx": torch.tensor([[5], [3], [-1]]).view(1, 3, 1, 1),
    }
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
    a = bench.make_workload(
        2, 64, 2, 16, 4096, 4, 4, decay=False, bank_dtype=torch.float32, dev="cpu", hot=8
    )
    slots = torch.cat([a["write_idx"].flatten(), a["read_idx"].flatten()]).unique()
    assert len(slots) == 8 and slots.min() >= 0 and slots.max() < 4096
    # Without hot, the indices spread over the whole bank.
    b = bench.make_workload(
        2, 64, 2, 16, 4096, 4, 4, decay=False, bank_dtype=torch.float32, dev="cpu"
    )
    assert len(torch.cat([b["write_idx"].flatten(), b["read_idx"].flatten()]).unique()) > 8


def test_help_exits_0_and_describes_every_option():
    done = run_module("benchmarks.bench", "--help")
    assert done.returncode == 0, done.stderr
    for action in bench.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
        for option in action.option_strings:
            assert option in done.stdout
    # The workload, every section and what is printed are described.
    for text in ("B=8, T=4096, H=8, D=64, S=65536", *bench.SECTIONS, "progress line", "--json"):
        assert text in done.stdout


def test_without_cuda_it_exits_2_and_says_why():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = run_module("benchmarks.bench", "--only", "main", env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m benchmarks.bench")
    assert "needs a CUDA GPU" in done.stderr
    assert done.stdout == ""


def test_an_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--only", "main,nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown section(s) ['nope']" in err and "snapshot-errors" in err


def test_snapshot_errors_write_json(tmp_path):
    # The one section that runs without a GPU; its figures and the run's provenance land in
    # the JSON file.
    path = tmp_path / "r.json"
    assert (
        bench.main(
            [
                "--only",
                "snapshot-errors",
                "--B",
                "1",
                "--T",
                "40",
                "--H",
                "1",
                "--D",
                "16",
                "--S",
                "64",
                "--W",
                "2",
                "--R",
                "2",
                "--chunk-size",
                "16",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    results = json.loads(path.read_text())
    assert results["workload"] == {
        "B": 1,
        "T": 40,
        "H": 1,
        "D": 16,
        "S": 64,
        "W": 2,
        "R": 2,
        "chunk_size": 16,
        "values": "bfloat16",
    }
    assert results["torch"] == torch.__version__ and results["device"]
    (section,) = results["sections"]
    assert [row["case"] for row in section["rows"]] == list(bench.SNAPSHOTS)
    keys = [c["key"] for c in section["columns"]]
    assert keys == ["bytes_per_token"] + [f"err_{n}" for n in bench.FLOATS]
    # 'none' against itself is exact; a float32 row of 16 is 64 bytes, 4 entries a token.
    none, bf16 = section["rows"][0], section["rows"][1]
    assert none["bytes_per_token"] == 256 and bf16["bytes_per_token"] == 128
    assert all(none[k] == 0 for k in keys[1:])
    assert all(0 <= bf16[k] < 0.1 for k in keys[1:])


@pytest.mark.parametrize(
    "intervals, want",
    [
        ([], (0.0, 0.0)),
        ([(0.0, 2.0)], (2.0, 2.0)),
        ([(5.0, 6.0), (0.0, 2.0)], (3.0, 6.0)),  # a gap of 3: busy 3 of 6
        ([(0.0, 4.0), (1.0, 2.0), (3.0, 5.0)], (5.0, 5.0)),  # nested and overlapping
        ([(0.0, 1.0), (1.0, 2.0), (4.0, 4.5)], (2.5, 4.5)),  # touching, then a gap
    ],
)
def test_gpu_busy_is_the_union_of_the_kernels_intervals(intervals, want):
    from benchmarks import _timing

    assert _timing.busy_and_span(intervals) == want
