"""The demo and its recipe (``sdm_ops.demo``, ``sdm_ops.examples.mqar``): the command lines, the
progress printer on a fake clock, the last lines that say whether a run reached its target,
and the recipe itself, trained for real: on several seeds, deterministic for
a seed and thread count, and, marked slow (``python -m pytest -m slow``), ``python -m
sdm_ops.demo`` as the README gives it."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from sdm_ops.examples import demo, mqar
from tests.helpers import FakeClock

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_progress_says_when_it_compiles_then_prints_on_time_not_on_steps():
    """begin at 0 s; the first (compiling) step ends at 30 s, then one step a second: lines
    5 s apart (steps 6 and 11) and at the last step, each with the mean loss since the
    previous line, the time elapsed and the steps left times the time of a later step."""
    lines = []
    clock = FakeClock([0.0] + [30.0 + i for i in range(12)])
    p = mqar.Progress(12, interval=5.0, compiling=True, log=lines.append, clock=clock)
    p.begin()
    assert lines == [
        (
            "compiling the model (torch.compile, fullgraph=True): the first step "
            "traces and compiles its forward and backward..."
        )
    ]
    for step in range(1, 13):
        p.update(step, loss=float(step), hits=step, total=20)
    assert lines[1] == "compiled in 30.0 s (the first step, compiling included); training..."
    assert lines[2:] == [
        "step 6/12  loss 3.5000  train accuracy 0.175  elapsed 35 s  about 6 s left",
        "step 11/12  loss 9.0000  train accuracy 0.450  elapsed 40 s  about 1 s left",
        "step 12/12  loss 12.0000  train accuracy 0.600  elapsed 41 s  about 0 s left",
    ]


def test_progress_without_compiling_estimates_from_the_first_step():
    lines = []
    clock = FakeClock([0.0, 2.0, 4.0, 6.0])
    p = mqar.Progress(3, interval=3.0, log=lines.append, clock=clock)
    p.begin()
    for step in (1, 2, 3):
        p.update(step, loss=1.0, hits=1, total=2)
    assert lines == [
        "step 2/3  loss 1.0000  train accuracy 0.500  elapsed 4 s  about 2 s left",
        "step 3/3  loss 1.0000  train accuracy 0.500  elapsed 6 s  about 0 s left",
    ]


def test_train_logs_every_step_at_interval_zero_and_ends_with_the_accuracy():
    """Three eager steps of a one-block model: the header, a line a step, the evaluation and
    the ``recall accuracy: <fraction>`` line last, whose value train returns."""
    lines = []
    one_block = dict(d_model=32, layers=1, heads=1, head_dim=16, factors=(4, 4))
    acc = mqar.train(
        3,
        compile=False,
        device="cpu",
        log_interval=0.0,
        eval_sequences=16,
        log=lines.append,
        read_topk=2,
        write_topk=2,
        **one_block,
    )
    assert lines[0].startswith("mqar: 8 pairs, 8 queries, T = 24") and "3 steps" in lines[0]
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/3", "2/3", "3/3"]
    assert all(re.search(r"elapsed \d+ s  about \d+ s left$", s) for s in steps)
    assert not any("compil" in line for line in lines)
    assert lines[-3] == "evaluating on 16 held-out sequences..."
    assert lines[-1] == f"recall accuracy: {acc:.4f}" and 0.0 <= acc <= 1.0


@pytest.mark.parametrize("parser", [demo.build_parser(), mqar.build_parser()], ids=["demo", "mqar"])
def test_every_option_has_help_and_the_description_says_what_it_does(parser):
    options = [a for a in parser._actions if a.dest != "help"]
    assert {"steps", "device", "no_compile", "seed", "threads", "log_interval"} <= {
        a.dest for a in options
    }
    for action in options:
        assert action.help and len(action.help) > 15, action.dest
    text = " ".join(parser.format_help().split())
    assert "multi-query associative recall" in text and "recall accuracy" in text
    assert "exit status is 0" in text
    args = parser.parse_args([])
    assert (args.steps, args.seed, args.threads, args.log_interval) == (mqar.STEPS, 0, None, 5.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--steps", "x"],
        ["--threads", "0"],
        ["--log-interval", "-1"],
        ["--log-interval", "nan"],
        ["--pairs", "0"],
    ],
)
def test_demo_rejects_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as e:
        demo.build_parser().parse_args(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_the_demo_checks_every_operator_against_float64(capsys):
    args = demo.build_parser().parse_args(["--pairs", "32", "--heads", "1", "--device", "cpu"])
    assert demo.check_operators(args)
    out = capsys.readouterr().out
    for op in ("product_key_topk", "sparse_delta_memory", "wy_solve"):
        assert f"[ok] {op}" in out
    assert "all checks passed" in out


def test_a_run_that_reaches_the_target_says_so_last():
    lines = []
    args = mqar.build_parser().parse_args(["--steps", "7", "--seed", "3"])
    assert mqar.report(mqar.TARGET_ACCURACY, args, log=lines.append)
    target = mqar.TARGET_ACCURACY
    assert lines == [f"target reached: recall accuracy {target:.4f} >= {target}"]


def test_a_run_short_of_the_target_says_so_and_what_to_try():
    lines = []
    args = mqar.build_parser().parse_args(["--steps", "7", "--seed", "3"])
    assert not mqar.report(0.9, args, log=lines.append)
    assert lines[0] == (
        f"SHORT OF THE TARGET: recall accuracy 0.9000 < {mqar.TARGET_ACCURACY} after 7 steps "
        "(seed 3); exit status 1"
    )
    assert "--steps 14" in lines[1] and "--seed 4" in lines[1]


def test_threads_are_set_only_when_given(monkeypatch):
    calls = []
    monkeypatch.setattr(mqar.torch, "set_num_threads", calls.append)
    mqar.set_threads(mqar.build_parser().parse_args(["--threads", "1"]))
    mqar.set_threads(mqar.build_parser().parse_args([]))
    assert calls == [1]


# The recipe as the demo runs it on the CPU (its task, model, optimizer, schedule and compiled
# training), on one thread: about a minute and a half a seed on an idle core. A shorter schedule
# is no test of it: over 400 steps seed 2 stayed below the target, and a smaller task learns no
# sooner a step (4 pairs of 16 keys stayed below 0.9 on two seeds of three after 400 steps).
# The recipe reaches the target on most seeds, not on all: some settle with keys sharing slots
# (the module's docstring). Which ones is chaotic: a change of about 1e-7 of the gradients'
# rounding (the same math, summed in another order) moved seed 2 from above 0.95 to 0.81 on
# one thread, while seeds 0 and 1 reached the target and 3 to 6 reached 0.99. So the demo's own
# seed must reach the target, and two of three others.


@pytest.fixture
def one_thread():
    """One CPU thread: deterministic results whatever the machine's cores, and no threads
    waiting on each other beside the other pytest-xdist worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _recipe(seed: int) -> tuple[float, list[str]]:
    lines = []
    acc = mqar.train(mqar.STEPS, seed=seed, device="cpu", log=lines.append, log_interval=30)
    return acc, lines


def test_the_recipe_reaches_the_target_on_the_demos_seed(one_thread):
    acc, lines = _recipe(mqar.build_parser().parse_args([]).seed)
    assert acc >= mqar.TARGET_ACCURACY, "\n".join(lines)


def test_the_recipe_reaches_the_target_on_two_of_three_other_seeds(one_thread):
    runs = {seed: _recipe(seed) for seed in (1, 2, 3)}
    reached = [seed for seed, (acc, _) in runs.items() if acc >= mqar.TARGET_ACCURACY]
    report = "\n".join(f"seed {s}: {acc:.4f}" for s, (acc, _) in runs.items())
    assert len(reached) >= 2, report


def test_training_is_deterministic_for_a_seed_and_thread_count(one_thread):
    """Two compiled runs of a few steps: the same loss and train accuracy at every step and the
    same recall."""
    runs = []
    for _ in range(2):
        lines = []
        acc = mqar.train(
            12,
            seed=5,
            device="cpu",
            log=lines.append,
            log_interval=0.0,
            eval_sequences=64,
        )
        runs.append(([line.split("  elapsed")[0] for line in lines if "step " in line], acc))
    assert len(runs[0][0]) == 12 and runs[0] == runs[1]


@pytest.mark.slow
def test_the_demo_reaches_its_target_with_the_default_recipe():
    """``python -m sdm_ops.demo`` as the README gives it, on the GPU when there is one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "sdm_ops.demo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = done.stdout.rstrip().splitlines()
    assert done.returncode == 0, "\n".join(out[-20:]) + done.stderr[-3000:]
    assert out[-2].startswith("recall accuracy: ") and out[-1].startswith("target reached")
