"""``torch.export`` and AOTInductor of a model built on ``SparseDeltaMemory`` (``sdm_ops.serve``).

CPU: the exported prompt program (dynamic batch and length) and decode program (the states
updated in place) run other batches and lengths equal to eager, a 64-token decode loop
included; their graphs hold the ``sdm`` operators as single nodes before and after
``run_decompositions()``; examples that would specialize are rejected. AOTInductor packages of
both programs, loaded in a fresh Python process, equal eager; such a CPU package calls the
operators' reference (Python custom operators) through the proxy executor, so the process must
``import sdm_ops`` before loading it. CUDA: the packages load in a fresh process that imports
torch alone, equal eager, and carry the sdm Triton kernels. Where a loading process is killed
by a signal and a package of one ``nn.Linear`` kills it too, the PyTorch build cannot load
packages at all and the fresh-process tests skip, saying so.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest
import torch

from sdm_ops.examples.tiny_lm import TinyLM
from sdm_ops.serve import export_decode, export_prompt
from tests.helpers import assert_close, kernel_modules, requires_cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = 2
MEMORY = dict(heads=2, head_dim=16, factors=(4, 8), read_topk=3, write_topk=2, chunk_size=16)
VOCAB = 64
# (batch, length) of prompts other than the example's (3, 37): one token, T = H = 2, one chunk,
# one chunk and a token, several chunks. The decode loop continues the last one (batch 4).
PROMPTS = [(1, 1), (2, 2), (2, 16), (3, 17), (4, 53)]
DECODE_STEPS = 64
EXPORT_RTOL = 1e-6  # exported against eager: the same operators, run from the graph
AOTI_RTOL = {"cpu": 1e-5, "cuda": 1e-4}  # AOTInductor fuses the projections differently


def make_model(device: str = "cpu") -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(vocab=VOCAB, d_model=32, layers=LAYERS, **MEMORY)
    with torch.no_grad():
        for memory in model.memories:
            memory.bank.normal_()  # a nonzero initial state
    return model.to(device).eval()


def tokens(B: int, T: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, T), generator=g).to(device)


def make_programs(model: TinyLM, device: str = "cpu") -> dict:
    """The prompt and decode programs, exported from a [3, 37] example prompt."""
    example = tokens(3, 37, seed=1, device=device)
    with torch.no_grad():
        _, states = model(example)
    kept = [s.clone() for s in states]
    return dict(
        prompt=export_prompt(model, example),
        decode=export_decode(model, example[:, :1], states),
        example_states=states,
        kept=kept,
    )


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return make_model()


@pytest.fixture(scope="module")
def programs(model) -> dict:
    return make_programs(model)


@pytest.fixture(scope="module")
def want(model) -> dict:
    return eager_run(model)


def eager_run(model: TinyLM, device: str = "cpu") -> dict:
    """What every program test compares with (the inputs included): the model on each prompt
    of PROMPTS, DECODE_STEPS decode steps from the last prompt's states and one step of batch
    1 from the first prompt's."""
    prompts = [tokens(B, T, seed=10 + i, device=device) for i, (B, T) in enumerate(PROMPTS)]
    decode_tokens = tokens(PROMPTS[-1][0], DECODE_STEPS, seed=99, device=device)
    with torch.no_grad():
        outs = [model(t) for t in prompts]
        states = [s.clone() for s in outs[-1][1]]
        logits = [model.step_(decode_tokens[:, t : t + 1], states) for t in range(DECODE_STEPS)]
        one = model.step_(decode_tokens[:1, :1], [s.clone() for s in outs[0][1]])
    return dict(
        prompts=prompts,
        decode_tokens=decode_tokens,
        outs=outs,
        decode=torch.cat(logits, dim=1),
        states=states,
        one=one,
    )


def check_run(got: dict, want: dict, rtol: float, what: str) -> None:
    """``got`` (``prompts``: (logits, states) per prompt; ``decode``: the decode loop's
    logits [B, DECODE_STEPS, vocab]; ``states`` after it; ``one``: the step of batch 1)
    equals the eager ``want``."""
    for (B, T), (logits, states), (want_logits, want_states) in zip(
        PROMPTS, got["prompts"], want["outs"]
    ):
        assert_close(logits, want_logits, rtol=rtol, name=f"{what}: logits (B={B}, T={T})")
        assert len(states) == LAYERS
        for i, (s, w) in enumerate(zip(states, want_states)):
            assert_close(s, w, rtol=rtol, name=f"{what}: state {i} (B={B}, T={T})")
    assert_close(got["decode"], want["decode"], rtol=rtol, name=f"{what}: decode logits")
    assert_close(got["one"], want["one"], rtol=rtol, name=f"{what}: decode logits (B=1)")
    for i, (s, w) in enumerate(zip(got["states"], want["states"])):
        assert_close(s, w, rtol=rtol, name=f"{what}: state {i} after the decode loop")


# ---------------------------------------------------------------------------
# torch.export (CPU)
# ---------------------------------------------------------------------------


def test_exported_programs_run_other_shapes_and_a_decode_loop_equal_to_eager(programs, want):
    prompt, decode = programs["prompt"].module(), programs["decode"].module()
    with torch.no_grad():
        outs = [prompt(t) for t in want["prompts"]]
        states = [s.clone() for s in outs[-1][1]]
        start = [s.clone() for s in states]
        dt = want["decode_tokens"]
        logits = [decode(dt[:, t : t + 1], states) for t in range(DECODE_STEPS)]
        one = decode(dt[:1, :1], [s.clone() for s in outs[0][1]])
    got = dict(prompts=outs, decode=torch.cat(logits, dim=1), states=states, one=one)
    check_run(got, want, EXPORT_RTOL, "exported program")
    assert all(not torch.equal(s, s0) for s, s0 in zip(states, start)), (
        "the decode program left the states it was given unchanged"
    )


def test_export_decode_leaves_its_example_states_unchanged(programs):
    for s, kept in zip(programs["example_states"], programs["kept"]):
        assert torch.equal(s, kept)


def sdm_nodes(program: torch.export.ExportedProgram) -> collections.Counter:
    """The ``sdm`` and ``sdm_internal`` operators the program's graphs call, by name; an
    operator that a functionalized graph wraps (``auto_functionalized``) counts as itself."""
    found = collections.Counter()
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            op = node.target
            if "auto_functionalized" in str(op):
                op = node.args[0]
            name = getattr(op, "name", lambda: "")()
            if name.startswith("sdm"):
                found[name] += 1
    return found


def test_graphs_hold_the_sdm_operators_before_and_after_decompositions(programs):
    prompt, decode = programs["prompt"], programs["decode"]
    want_prompt = {"sdm::product_key_topk": 2 * LAYERS, "sdm::sparse_delta_memory": LAYERS}
    want_decode = {"sdm::product_key_topk": 2 * LAYERS, "sdm::sparse_delta_memory_": LAYERS}
    assert sdm_nodes(prompt) == want_prompt
    assert sdm_nodes(decode) == want_decode
    decomposed_prompt, decomposed_decode = prompt.run_decompositions(), decode.run_decompositions()
    assert sdm_nodes(decomposed_prompt) == want_prompt
    assert sdm_nodes(decomposed_decode) == want_decode
    # The functional decode graph returns the new states as mutations of its inputs.
    signature = decomposed_decode.graph_signature
    mutated = sorted(signature.user_inputs_to_mutate.values())
    assert mutated == sorted(signature.user_inputs[1:]) and len(mutated) == LAYERS


@pytest.mark.parametrize(
    "which, example, error, match",
    [
        ("prompt", (1, 37), ValueError, r"B >= 2"),
        ("prompt", (3, 16), ValueError, r"T > 16, more than one chunk"),
        ("decode", (3, 2), ValueError, r"T = 1"),
        ("decode", (1, 1), ValueError, r"B >= 2"),
        ("decode", "list", TypeError, r"tokens must be a torch.Tensor"),
    ],
)
def test_examples_that_would_specialize_are_rejected(model, which, example, error, match):
    states = [torch.zeros(3, 2, 32, 16) for _ in range(LAYERS)]
    x = [[1]] * 3 if example == "list" else tokens(*example, seed=0)
    with pytest.raises(error, match=match):
        if which == "prompt":
            export_prompt(model, x)
        else:
            export_decode(model, x, states)


def test_export_decode_rejects_states_it_cannot_update_in_place(model):
    x = tokens(3, 1, seed=0)
    with pytest.raises(ValueError, match=r"states\[1\] must be contiguous"):
        export_decode(model, x, [torch.zeros(3, 2, 32, 16), torch.zeros(3, 2, 16, 32).mT])
    with pytest.raises(ValueError, match=r"states\[0\] must be a tensor \[B = 3"):
        export_decode(model, x, [torch.zeros(2, 2, 32, 16)] * 2)


# ---------------------------------------------------------------------------
# AOTInductor: packages loaded in a fresh process
# ---------------------------------------------------------------------------

# Loads the packages in a process that imports torch (and sdm_ops where asked, after a first
# attempt without it), runs the prompts and the decode loop given in argv[1] and saves the
# results to argv[2].
LOADER = r"""
import sys
import torch

io = torch.load(sys.argv[1])
result = {"load_error": None}
try:
    torch._inductor.aoti_load_package(io["prompt_path"])
except RuntimeError as e:
    result["load_error"] = str(e)
if io["import_sdm_ops"]:
    import sdm_ops  # noqa: F401  (registers the operators' reference that a CPU package calls)
prompt = torch._inductor.aoti_load_package(io["prompt_path"])
decode = torch._inductor.aoti_load_package(io["decode_path"])
with torch.no_grad():
    result["prompts"] = [prompt(t) for t in io["prompts"]]
    states = [s.clone() for s in result["prompts"][-1][1]]
    dt = io["decode_tokens"]
    logits = [decode(dt[:, t : t + 1].contiguous(), states) for t in range(dt.shape[1])]
    first = [s.clone() for s in result["prompts"][0][1]]
    result["one"] = decode(dt[:1, :1].contiguous(), first)
result["decode"] = torch.cat(logits, dim=1)
result["states"] = states
result["sdm_ops_imported"] = "sdm_ops" in sys.modules
torch.save(result, sys.argv[2])
"""


def compile_packages(programs: dict, directory: pathlib.Path) -> dict[str, str]:
    # The C++ wrapper built without optimization compiles a third faster; it only sequences
    # kernel calls (where the PyTorch version has the option).
    configs = {}
    if hasattr(torch._inductor.config.aot_inductor, "compile_wrapper_opt_level"):
        configs["aot_inductor.compile_wrapper_opt_level"] = "O0"
    return {
        name: torch._inductor.aoti_compile_and_package(
            programs[name],
            package_path=str(directory / f"{name}.pt2"),
            inductor_configs=configs,
        )
        for name in ("prompt", "decode")
    }


def run_in_fresh_process(
    paths: dict[str, str], want: dict, directory: pathlib.Path, import_sdm_ops: bool
) -> dict:
    io = dict(
        prompt_path=paths["prompt"],
        decode_path=paths["decode"],
        prompts=want["prompts"],
        decode_tokens=want["decode_tokens"],
        import_sdm_ops=import_sdm_ops,
    )
    src, dst = directory / "io.pt", directory / "result.pt"
    torch.save(io, src)
    env = dict(os.environ)
    if import_sdm_ops:  # found from the repository, not from the working directory
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, str(src), str(dst)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode < 0:  # killed by a signal: is it this package, or every package?
        skip_if_aoti_cannot_load_any_package(directory)
    assert proc.returncode == 0, f"the loading process failed:\n{proc.stderr[-4000:]}"
    return torch.load(dst)


# A package of one nn.Linear, loaded in a fresh process: the smallest AOTInductor round trip.
LINEAR_LOADER = r"""
import sys
import torch

f = torch._inductor.aoti_load_package(sys.argv[1])
assert f(torch.ones(2, 8)).shape == (2, 8)
"""


def skip_if_aoti_cannot_load_any_package(directory: pathlib.Path) -> None:
    """Skip where a package of one ``nn.Linear`` (CPU) also kills the loading process: then
    AOTInductor cannot load any package with this PyTorch build, whatever the sdm operators do
    (a PyTorch build that crashes so is named in README's AOTInductor section)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8).eval()
    program = torch.export.export(linear, (torch.ones(2, 8),))
    path = torch._inductor.aoti_compile_and_package(
        program, package_path=str(directory / "linear.pt2")
    )
    proc = subprocess.run(
        [sys.executable, "-c", LINEAR_LOADER, path], capture_output=True, text=True, timeout=600
    )
    if proc.returncode < 0:
        pytest.skip(
            f"torch {torch.__version__}: a fresh process loading an AOTInductor package of one "
            f"nn.Linear dies with signal {-proc.returncode}, so no package can be checked here"
        )


def package_files(path: str, suffix: str) -> dict[str, str]:
    """The text of the package's files whose names end with ``suffix``, by name."""
    with zipfile.ZipFile(path) as z:
        return {
            n: z.read(n).decode("utf-8", errors="replace")
            for n in z.namelist()
            if n.endswith(suffix)
        }


def proxy_executor_ops(path: str) -> set[str]:
    """The operators that the package calls through AOTInductor's proxy executor (extern
    nodes of its ``*.wrapper.json``), which a loading process must have registered."""
    ops = set()
    for text in package_files(path, ".json").values():
        data = json.loads(text)
        if isinstance(data, dict) and "nodes" in data:
            ops.update(n["node"]["target"] for n in data["nodes"])
    return ops


@pytest.fixture(scope="module")
def cpu_packages(programs, tmp_path_factory) -> dict[str, str]:
    return compile_packages(programs, tmp_path_factory.mktemp("cpu_packages"))


@pytest.fixture(scope="module")
def cpu_run(cpu_packages, want, tmp_path_factory) -> tuple[dict, dict]:
    directory = tmp_path_factory.mktemp("cpu_run")
    return run_in_fresh_process(cpu_packages, want, directory, import_sdm_ops=True), want


def test_cpu_packages_in_a_fresh_process_equal_eager(cpu_run):
    got, want = cpu_run
    check_run(got, want, AOTI_RTOL["cpu"], "CPU package")


def test_cpu_packages_need_sdm_ops_imported_to_load(cpu_run, cpu_packages):
    got, _ = cpu_run
    # Loaded before ``import sdm_ops``: the proxy executor finds no schema for the reference.
    assert got["load_error"] is not None, "a CPU package loaded without sdm_ops imported"
    assert "Could not find schema for sdm_internal::" in got["load_error"]
    prompt_ops, decode_ops = (proxy_executor_ops(cpu_packages[n]) for n in ("prompt", "decode"))
    assert all(re.fullmatch(r"sdm_internal::\w+_reference", op) for op in prompt_ops | decode_ops)
    assert {
        "sdm_internal::product_key_topk_reference",
        "sdm_internal::recurrence_fwd_inplace_reference",
    } <= prompt_ops
    assert decode_ops == {
        "sdm_internal::product_key_topk_reference",
        "sdm_internal::decode_step_inplace_reference",
    }


# ---------------------------------------------------------------------------
# AOTInductor on CUDA: no sdm_ops at load, the sdm Triton kernels in the package
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_model() -> TinyLM:
    return make_model("cuda")


@pytest.fixture(scope="module")
def cuda_packages(cuda_model, tmp_path_factory) -> dict[str, str]:
    programs = make_programs(cuda_model, "cuda")
    return compile_packages(programs, tmp_path_factory.mktemp("cuda_packages"))


@requires_cuda
def test_cuda_packages_load_in_a_process_without_sdm_ops_and_equal_eager(
    cuda_model, cuda_packages, tmp_path
):
    want = eager_run(cuda_model, "cuda")
    got = run_in_fresh_process(cuda_packages, want, tmp_path, import_sdm_ops=False)
    assert got["load_error"] is None, f"loading without sdm_ops failed: {got['load_error']}"
    assert not got["sdm_ops_imported"]
    check_run(got, want, AOTI_RTOL["cuda"], "CUDA package")


def kernels_named_in(kernels, texts) -> list[str]:
    """Those of ``kernels`` that ``texts`` (the package's generated C++ and its file names)
    name outside comments (the wrapper loads each kernel by name; Inductor may add a
    ``_<n>`` suffix), sorted."""
    code = "\n".join(re.sub(r"//[^\n]*", "", t) for t in texts)
    return sorted(k for k in kernels if re.search(rf"(?<!\w){re.escape(k)}(_\d+)?(?!\w)", code))


@requires_cuda
def test_cuda_packages_carry_the_sdm_kernels_and_call_no_python_operator(cuda_model, cuda_packages):
    from torch._inductor.utils import run_and_get_code

    from compile_tests import kernels_defined_in, launched_kernels

    candidates = sorted({k for m in kernel_modules() for k in launched_kernels(m)})
    x = tokens(3, 37, seed=1, device="cuda")
    with torch.no_grad():
        _, states = cuda_model(x)
    cases = {
        "prompt": (cuda_model, (x,), {"_recurrence_fwd_kernel", "_product_key_topk_fwd"}),
        "decode": (cuda_model.step_, (x[:, :1], states), {"_decode_step_kernel"}),
    }
    for name, (fn, args, core) in cases.items():
        # What torch.compile's output code defines for the same computation.
        torch._dynamo.reset()
        with torch.no_grad():
            _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
        want = kernels_defined_in(candidates, codes)
        assert core <= set(want), f"{name}: torch.compile defines {want}"
        with zipfile.ZipFile(cuda_packages[name]) as z:
            names = z.namelist()
        texts = [*package_files(cuda_packages[name], ".cpp").values(), *names]
        got = kernels_named_in(candidates, texts)
        missing = sorted(set(want) - set(got))
        assert not missing, (
            f"{name}: the package's C++ lacks {missing}; it names {got}, torch.compile's "
            f"output code defines {want}"
        )
        ops = proxy_executor_ops(cuda_packages[name])
        assert not any(op.startswith("sdm") for op in ops), f"{name} calls {sorted(ops)}"
    torch._dynamo.reset()
