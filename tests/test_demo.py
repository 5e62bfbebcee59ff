"""The demo's and the MQAR trainer's command lines and progress lines (``sdm_ops.demo``,
``sdm_ops.mqar``), without the minutes of a full training run: the progress printer on a fake
clock, a few eager steps of a small model, and the exit status with the training replaced."""

from __future__ import annotations

import re

import pytest

from sdm_ops import demo, mqar


class FakeClock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


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
    acc = mqar.train(
        3,
        compile=False,
        device="cpu",
        log_interval=0.0,
        eval_sequences=16,
        log=lines.append,
        d_model=32,
        layers=1,
        heads=1,
        head_dim=16,
        factors=(4, 4),
        read_topk=2,
        write_topk=2,
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


@pytest.mark.parametrize("acc,code", [(mqar.TARGET_ACCURACY, 0), (0.5, 1)])
def test_demo_exit_status_follows_the_checks_and_the_accuracy(acc, code, monkeypatch, capsys):
    """The operator checks run for real (small), the training is replaced."""
    seen = []
    monkeypatch.setattr(mqar, "train_from_args", lambda args: seen.append(args) or acc)
    assert demo.main(["--pairs", "32", "--heads", "1", "--steps", "7", "--device", "cpu"]) == code
    assert seen[0].steps == 7 and seen[0].device == "cpu" and not seen[0].no_compile
    out = capsys.readouterr().out
    assert "[ok] product_key_topk" in out and "all checks passed" in out
    monkeypatch.setattr(demo, "check_operators", lambda args: False)
    assert demo.main(["--device", "cpu"]) == 1


def test_mqar_exit_status_follows_the_accuracy(monkeypatch):
    monkeypatch.setattr(mqar, "train_from_args", lambda args: 0.95)
    assert mqar.main(["--steps", "3"]) == 0
    monkeypatch.setattr(mqar, "train_from_args", lambda args: 0.85)
    assert mqar.main([]) == 1


def test_threads_are_set_only_when_given(monkeypatch):
    calls = []
    monkeypatch.setattr(mqar.torch, "set_num_threads", calls.append)
    monkeypatch.setattr(mqar, "train_from_args", lambda args: 1.0)
    assert mqar.main(["--threads", "1"]) == 0 and calls == [1]
    assert mqar.main([]) == 0 and calls == [1]
