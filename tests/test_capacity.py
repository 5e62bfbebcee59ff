"""``python -m benchmarks.capacity``: the dense layer is DeltaNet, the two memory layers have the
same parameter count, and a small sweep on the CPU trains both models, whose recalls (the
table, the JSON file and the plot) are those of the trained models on the held-out sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from benchmarks import _plot, capacity, table
from sdm_ops import sparse_delta_memory
from sdm_ops.examples import mqar
from tests.helpers import FakeClock, run_module

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Two numbers of pairs, a few steps (15 for the new models, 10 more at 8 pairs): seconds on a
# CPU. key_dim = 16 / 2 = 8 and
# mean(factors) = d_model: both memory layers have 5186 parameters.
TINY = capacity.Config(
    pairs=(2, 8),
    max_queries=8,
    keys_per_pair=2,
    values=16,
    d_model=32,
    heads=2,
    head_dim=16,
    factors=(32, 32),
    topk=4,
    layers=1,
    chunk_size=16,
    steps=10,
    first_steps=15,
    batch_tokens=192,
    max_batch=16,
    lr=1e-2,
    warmup=5,
    eval_sequences=16,
)


def deltanet_tokenwise(layer: capacity.DenseDeltaRule, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed token by token in float64 from its projections: the
    state S [H, D, D] (key rows, value columns) from zero, S += beta k (v - S^T k)^T, then
    o = S^T q, gated by 2 sigmoid(g) and projected."""
    B, T, _ = x.shape
    H, D = layer.heads, layer.head_dim
    with torch.no_grad():
        xd = x.double()
        w = {n: getattr(layer, n).weight.double() for n in ("q_proj", "k_proj", "v_proj")}
        q = F.normalize((xd @ w["q_proj"].T).view(B, T, H, D), dim=-1)
        k = F.normalize((xd @ w["k_proj"].T).view(B, T, H, D), dim=-1)
        v = (xd @ w["v_proj"].T).view(B, T, H, D)
        beta = torch.sigmoid(xd @ layer.b_proj.weight.double().T + layer.b_proj.bias.double())
        out = torch.zeros(B, T, H, D, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                S = torch.zeros(D, D, dtype=torch.float64)
                for t in range(T):
                    kt, vt = k[b, t, h], v[b, t, h]
                    S = S + beta[b, t, h] * torch.outer(kt, vt - S.T @ kt)
                    out[b, t, h] = S.T @ q[b, t, h]
        gate = 2 * torch.sigmoid(xd @ layer.g_proj.weight.double().T)
        return (out.reshape(B, T, H * D) * gate) @ layer.o_proj.weight.double().T


def dense_layer(**kwargs) -> capacity.DenseDeltaRule:
    """A small dense layer whose gate is not the initial one (a gate of 1 everywhere)."""
    torch.manual_seed(0)
    layer = capacity.DenseDeltaRule(24, heads=2, head_dim=16, chunk_size=16, **kwargs)
    assert torch.equal(layer.g_proj.weight, torch.zeros_like(layer.g_proj.weight))
    with torch.no_grad():
        layer.g_proj.weight.normal_(0, 0.3)
    return layer


def test_the_dense_layer_on_the_cpu_is_the_delta_rule():
    layer = dense_layer(backend="sdm")
    x = torch.randn(2, 37, 24)
    y = layer(x)
    want = deltanet_tokenwise(layer, x)
    assert y.shape == (2, 37, 24)
    err = ((y.double() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    # "auto" on the CPU is the same computation; every projection gets a gradient.
    layer.backend = "auto"
    assert torch.equal(layer(x), y)
    layer(x).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_the_fla_path_passes_unit_keys_in_bfloat16_time_first(monkeypatch):
    """fla-core needs a GPU: a stand-in with chunk_delta_rule's signature (head-first by
    default, as in older versions) records what it gets and runs the full addressing."""
    calls = []

    def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, head_first=True):
        calls.append((q.dtype, k.dtype, v.dtype, beta.dtype, scale, head_first, q.shape))
        B, T, H, K = k.shape
        slots = torch.arange(K).expand(B, T, H, K)
        state = torch.zeros(H, K, v.shape[-1])
        args = (v.float(), beta.float(), slots, k.float(), slots, q.float(), state)
        out, _ = sparse_delta_memory(*args, chunk_size=16)
        return out.to(v.dtype), None

    monkeypatch.setattr(capacity, "fla_delta_rule", lambda: (chunk_delta_rule, None))
    monkeypatch.setattr(capacity, "resolve_backend", lambda backend, device: "fla")
    layer = dense_layer()
    x = torch.randn(2, 37, 24)
    y = layer(x)
    bf16 = torch.bfloat16
    assert calls == [(bf16, bf16, bf16, bf16, 1.0, False, (2, 37, 2, 16))]
    assert y.dtype == torch.float32
    want = deltanet_tokenwise(layer, x)
    assert ((y.double() - want).abs().max() / want.abs().max()).item() < 3e-2


def test_backend_choice_and_bad_arguments():
    assert capacity.resolve_backend("auto", "cpu") == "sdm"
    assert capacity.resolve_backend("sdm", "cpu") == "sdm"
    with pytest.raises(ValueError, match="backend"):
        capacity.resolve_backend("cuda", "cpu")
    fla, _ = capacity.fla_delta_rule()
    with pytest.raises(ValueError, match="backend 'fla'"):
        capacity.resolve_backend("fla", "cpu")  # a CUDA device, or fla-core, is missing
    with pytest.raises(ValueError, match="head_dim must be at most 64"):
        capacity.DenseDeltaRule(32, heads=1, head_dim=128, backend="sdm")
    with pytest.raises(ValueError, match="head_dim must be one of"):
        capacity.DenseDeltaRule(32, heads=1, head_dim=24)
    with pytest.raises(TypeError, match="heads must be an int"):
        capacity.DenseDeltaRule(32, heads=2.0, head_dim=16)
    with pytest.raises(ValueError, match="x must have shape"):
        capacity.DenseDeltaRule(32, heads=1, head_dim=16)(torch.zeros(1, 3, 16))
    if fla is None:
        # auto falls back to the full addressing, which holds at most 64 slots a token.
        with pytest.raises(ValueError, match="needs fla-core on a GPU"):
            capacity.DenseDeltaRule(32, heads=1, head_dim=128)(torch.zeros(1, 3, 32))


@pytest.mark.parametrize(
    "cfg", [capacity.Config(), capacity.SMALL, TINY], ids=["default", "small", "tiny"]
)
def test_the_memory_layers_have_the_same_parameter_count(cfg):
    counts = capacity.check_parameter_counts(cfg)
    assert counts["sdm"] == counts["dense"] > 0


def test_the_sdm_bank_is_a_zero_state_not_trained():
    sdm = capacity.memory_layer("sdm", TINY)
    assert not sdm.bank.requires_grad and torch.count_nonzero(sdm.bank) == 0
    assert capacity.trained_parameters(sdm) == 5186


def test_parameter_counts_far_apart_are_refused():
    cfg = dataclasses.replace(TINY, factors=(128, 128))  # 4 times as many sub-keys
    with pytest.raises(ValueError, match="parameter counts differ by more than 10%"):
        capacity.check_parameter_counts(cfg)
    with pytest.raises(ValueError, match="keys_per_pair"):
        dataclasses.replace(TINY, keys_per_pair=0).check()
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(TINY, factors=(4, 4, 4)).check()  # 16 is no multiple of 3


def test_sweep_progress_counts_the_whole_sweep_and_prices_each_model_apart():
    """Two models, 10 steps each new, then 5 more each: 30 steps. The sdm model's steps take
    1 s; before the dense model has run its steps are priced at the sweep's mean so far, then
    at its own 3 s."""
    clock = FakeClock([0.0, 0.0, 5.0, 10.0, 10.0, 16.0])
    p = capacity.SweepProgress([("sdm", 10), ("dense", 10), ("sdm", 5), ("dense", 5)], clock)
    p.begin("sdm")
    assert p.status(5) == "sweep 5/30 steps  elapsed 5 s  about 25 s left"
    p.end(10)
    p.begin("dense")
    assert p.status(2) == "sweep 12/30 steps  elapsed 16 s  about 44 s left"


@contextlib.contextmanager
def one_thread():
    """PyTorch on one thread: on busy cores its threads waiting on each other take many
    times longer over these small operators."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def swept():
    lines: list[str] = []
    with one_thread():
        results, trained = capacity.sweep(TINY, "cpu", log=lines.append, log_interval=0.0)
    return results, trained, lines


def independent_recall(model, task: mqar.MQARTask, sequences: int) -> float:
    """Recall on the held-out sequences from the logits of every position, the query
    positions picked by their labels."""
    g = torch.Generator().manual_seed(capacity.EVAL_SEED)
    tokens, labels = task.batch(sequences, g)
    with torch.no_grad():
        logits = model.eval()(tokens)
    asked = labels != mqar.IGNORE
    return ((logits.argmax(-1) == labels) & asked).sum().item() / asked.sum().item()


def test_the_recalls_are_those_of_the_trained_models(swept):
    results, trained, lines = swept
    assert [(t.kind, t.pairs) for t in trained] == [
        (kind, p) for p in TINY.pairs for kind in capacity.MODELS
    ]
    recalls = []
    for t in trained:
        task = TINY.task(t.pairs)
        assert t.seq_len == task.seq_len == 2 * t.pairs + min(t.pairs, TINY.max_queries)
        assert 0.0 <= t.recall <= 1.0 and t.train_s > 0
        assert t.recall == independent_recall(t.model, task, TINY.eval_sequences)
        # Trained: the weights moved away from the initialization of the same seed.
        fresh = capacity.build_model(t.kind, TINY, task)
        assert not torch.equal(fresh.head.weight, t.model.head.weight)
        recalls.append(t.recall)
    assert len(set(recalls)) > 1, recalls
    # The results hold the same figures, point by point.
    assert [p["recall"] for p in results["points"]] == recalls
    assert [p["model"] for p in results["points"]] == [t.kind for t in trained]
    # Progress: the header, each run announced, a line per step at interval 0, the result.
    assert lines[0].startswith("capacity: multi-query associative recall at 2, 8 pairs")
    assert "5186 parameters" in lines[1] and "5186 parameters" in lines[2]
    assert "sparse_delta_memory, full addressing" in lines[2]
    announced = [line.split(":")[0] for line in lines if line.startswith("[")]
    assert announced == [
        "[1/4] sdm at 2 pairs (new, 15 steps)",
        "[2/4] dense at 2 pairs (new, 15 steps)",
        "[3/4] sdm at 8 pairs (from 2 pairs, 10 steps)",
        "[4/4] dense at 8 pairs (from 2 pairs, 10 steps)",
    ]
    assert [t.steps for t in trained] == [15, 15, 10, 10]
    assert sum("dense 2 pairs: step " in line for line in lines) == 15
    assert sum("dense 8 pairs: step " in line for line in lines) == 10
    assert f"  sdm 2 pairs: recall {trained[0].recall:.4f}" in "\n".join(lines)


def test_from_scratch_every_model_is_new():
    cfg = dataclasses.replace(TINY, pairs=(2, 3), first_steps=3, warm_start=False)
    lines: list[str] = []
    with one_thread():
        results, trained = capacity.sweep(cfg, "cpu", log=lines.append, log_interval=100.0)
    assert [line.split(":")[0] for line in lines if line.startswith("[")] == [
        f"[{i}/4] {kind} at {p} pairs (new, 3 steps)"
        for i, (p, kind) in enumerate([(2, "sdm"), (2, "dense"), (3, "sdm"), (3, "dense")], 1)
    ]
    assert "3 steps from scratch at each number of pairs" in results["sections"][0]["title"]
    assert [t.steps for t in trained] == [3, 3, 3, 3]


def test_table_and_json(swept, tmp_path, capsys):
    results, trained, _ = swept
    args = capacity.build_parser().parse_args(
        ["--json", str(tmp_path / "r" / "cap.json"), "--no-plot"]
    )
    capacity.write_outputs(results, args)
    out = capsys.readouterr().out.splitlines()
    # The table: a header, a rule, a row per number of pairs with each model's recall.
    start = out.index(next(line for line in out if line.split()[:2] == ["pairs", "T"]))
    header = out[start].split()
    assert header == [
        "pairs",
        "T",
        "sdm",
        "recall",
        "dense",
        "recall",
        "sdm",
        "train",
        "s",
        "dense",
        "train",
        "s",
    ]
    by = {(t.kind, t.pairs): t for t in trained}
    for row, pairs in zip(out[start + 2 : start + 4], TINY.pairs):
        cells = row.split()
        assert cells[:4] == [
            str(pairs),
            str(by["sdm", pairs].seq_len),
            f"{by['sdm', pairs].recall:.3f}",
            f"{by['dense', pairs].recall:.3f}",
        ]
    saved = json.loads((tmp_path / "r" / "cap.json").read_text())
    assert saved["points"] == results["points"] and saved["config"]["pairs"] == [2, 8]
    # benchmarks/table.py renders the file's section as Markdown.
    md = table.markdown(saved)
    assert "| 8 pairs | 24 | " in md and f"{by['dense', 8].recall:.3f}" in md
    assert not any("plot" in line for line in out)


def test_the_plot_is_written(swept, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results, _, _ = swept
    path = tmp_path / "figs" / "cap.png"
    capacity.write_outputs(results, capacity.build_parser().parse_args(["--plot", str(path)]))
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert f"plot written to {path}" in capsys.readouterr().out


def block_matplotlib(monkeypatch) -> None:
    """Every import of matplotlib or of its modules fails, as where it is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_without_matplotlib_the_table_comes_and_says_how_to_get_the_plot(
    swept, tmp_path, capsys, monkeypatch
):
    block_matplotlib(monkeypatch)
    assert not _plot.available()
    results, _, _ = swept
    args = capacity.build_parser().parse_args(["--plot", str(tmp_path / "cap.png")])
    capacity.write_outputs(results, args)
    out = capsys.readouterr().out
    assert "dense recall" in out
    assert "no plot written: it needs matplotlib (pip install 'sdm_ops[plot]')" in out
    assert not (tmp_path / "cap.png").exists()
    with pytest.raises(ImportError, match=r"sdm_ops\[plot\]"):
        capacity.plot_recall(results, str(tmp_path / "cap.png"))


def test_from_json_prints_the_table_and_plots_again(swept, tmp_path, capsys):
    results, trained, _ = swept
    path = tmp_path / "cap.json"
    path.write_text(json.dumps(results))
    argv = ["--from-json", str(path), "--plot", str(tmp_path / "again.png")]
    assert capacity.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{trained[-1].recall:.3f}" in out and "step" not in out
    if _plot.available():
        assert (tmp_path / "again.png").read_bytes()[:8] == PNG_MAGIC


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        capacity.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for action in capacity.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
        for option in action.option_strings:
            assert option in out
    words = " ".join(out.split())  # argparse wraps the lines
    for text in ("(default 16 32 64 128 256 512 1024 2048 4096)", "sdm_ops[plot]", "--small:"):
        assert text in words


def test_the_command_trains_and_writes_its_files(tmp_path):
    """The whole command on the smallest sweep: one number of pairs, two steps."""
    done = run_module(
        "benchmarks.capacity",
        "--small",
        "--pairs",
        "3",
        "--keys-per-pair",
        "2",
        "--steps",
        "2",
        "--eval-sequences",
        "4",
        "--threads",
        "1",
        "--log-interval",
        "0",
        "--json",
        str(tmp_path / "c.json"),
        "--no-plot",
    )
    assert done.returncode == 0, done.stderr
    # A new model trains twice --steps; each progress line states the whole sweep's progress.
    assert "  sdm 3 pairs: step 4/4" in done.stdout and "  dense 3 pairs: step 4/4" in done.stdout
    last = [line for line in done.stdout.splitlines() if "dense 3 pairs: step 4/4" in line][0]
    assert re.search(r"  sweep 8/8 steps  elapsed \d+ s  about 0 s left$", last), last
    points = json.loads((tmp_path / "c.json").read_text())["points"]
    assert [(p["model"], p["pairs"], p["seq_len"]) for p in points] == [
        ("sdm", 3, 9),
        ("dense", 3, 9),
    ]
    assert "plot written" not in done.stdout


def test_options_override_the_preset():
    parse = capacity.build_parser().parse_args
    cfg = capacity.config_from_args(parse(["--small", "--steps", "7", "--factors", "8", "4"]))
    assert cfg == dataclasses.replace(capacity.SMALL, steps=7, factors=(8, 4))
    cfg = capacity.config_from_args(parse(["--pairs", "5", "9", "--from-scratch"]))
    assert cfg == dataclasses.replace(capacity.Config(), pairs=(5, 9), warm_start=False)
    assert cfg.new_model_steps == capacity.Config().first_steps
    cfg = capacity.config_from_args(parse(["--small", "--steps", "7"]))
    assert cfg.new_model_steps == 14  # --small: twice --steps
    cfg = capacity.config_from_args(parse(["--first-steps", "11"]))
    assert cfg.new_model_steps == 11 and cfg.steps == capacity.Config().steps


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--factors", "128", "128"], "parameter counts differ by more than 10%"),
        (["--keys-per-pair", "0"], "--keys-per-pair: must be a positive integer, got 0"),
        (["--steps", "0"], "--steps: must be a positive integer, got 0"),
        (["--dense-backend", "fla", "--device", "cpu"], "backend 'fla'"),
    ],
)
def test_bad_options_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        capacity.main(["--small", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m benchmarks.capacity") and message in err


def test_the_token_layout_is_the_same_at_every_number_of_pairs():
    """The key vocabulary grows with the pairs (keys_per_pair * P), the values' ids stay after
    the largest one, so a model continues from one number of pairs to the next."""
    cfg = dataclasses.replace(TINY, pairs=(2, 8), keys_per_pair=3)
    g = torch.Generator().manual_seed(0)
    for pairs in cfg.pairs:
        task = cfg.task(pairs)
        assert task.num_keys == 3 * pairs and task.vocab == cfg.vocab == 24 + cfg.values
        tokens, labels = task.batch(64, g)
        keys, values = tokens[:, : 2 * pairs : 2], tokens[:, 1 : 2 * pairs : 2]
        assert keys.min() >= 0 and keys.max() < 3 * pairs
        assert values.min() >= 24 and values.max() < 24 + cfg.values
        assert len(set(keys.flatten().tolist())) == 3 * pairs  # every key is drawn
        # Each query's label is the value stored under its key.
        for b in range(tokens.shape[0]):
            stored = dict(zip(keys[b].tolist(), values[b].tolist()))
            asked = tokens[b, 2 * pairs :].tolist()
            assert labels[b, 2 * pairs :].tolist() == [stored[k] for k in asked]
            assert (labels[b, : 2 * pairs] == mqar.IGNORE).all()
    with pytest.raises(ValueError, match="value_offset"):
        mqar.MQARTask(num_keys=8, value_offset=4)


# One number of pairs at which the SDM model learns on a CPU in under a minute: 16 keys (4 a
# pair), 16 values, 32 sequences a step, 200 steps.
LEARNS = dataclasses.replace(
    TINY,
    pairs=(4,),
    max_queries=4,
    keys_per_pair=4,
    layers=2,
    first_steps=200,
    batch_tokens=4096,
    max_batch=32,
    warmup=20,
    eval_sequences=256,
)


def test_the_sdm_model_learns_recall_at_a_few_pairs():
    """Recall far above chance (1 / values) on the held-out sequences, and the loss far below
    that of the values' uniform distribution, where a model that learns nothing settles.
    This model recalls nearly every query; with 4096 keys instead of 16 (a sweep's largest
    vocabulary from its first number of pairs on) it recalls under a fifth."""
    with one_thread():
        t = capacity.train_point("sdm", 4, LEARNS, "cpu", log=lambda s: None)
    chance = 1 / LEARNS.values
    assert t.recall > 8 * chance, t.recall
    assert t.final_loss < math.log(LEARNS.values) - 1.5, t.final_loss
