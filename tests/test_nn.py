"""The ``SparseDeltaMemory`` layer (``sdm_ops.nn``): shapes, gradients reaching every
parameter, continuing from a returned state and decoding with ``step_`` equal to one pass over
the whole sequence, decay on and off, constructor validation, and a few training steps
lowering the loss. CPU, eager."""

from __future__ import annotations

import pytest
import torch

from sdm_ops.nn import SparseDeltaMemory
from tests.helpers import SMALL_LAYER, assert_close

RTOL = 1e-5  # the same recurrence split differently: float32 rounding
B, T, D_MODEL = 2, 37, 32
OPTIONS = dict(SMALL_LAYER, d_model=D_MODEL, chunk_size=16)  # the layer of most tests


def make_layer(seed: int = 0, **kwargs) -> SparseDeltaMemory:
    """A small layer; ``factors (4, 4)`` gives 16 slots, so tokens often share slots (and
    decay and overwrite what earlier tokens wrote). The initial bank is random, not zeros."""
    opts = OPTIONS | kwargs
    torch.manual_seed(seed)
    layer = SparseDeltaMemory(**opts)
    with torch.no_grad():
        layer.bank.normal_()
    return layer


def make_x(T: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("decay", [True, False])
def test_output_and_state_shapes(decay):
    layer = make_layer(use_decay=decay)
    x = make_x()
    y = layer(x)
    assert y.shape == (B, T, D_MODEL) and y.dtype == torch.float32
    y2, state = layer(x, return_state=True)
    assert state.shape == (B, 2, 16, 16)
    assert_close(y2, y, rtol=0, atol=0, name="y with return_state")
    assert layer.initial_state(B).shape == (B, 2, 16, 16)


def test_zero_length_sequence_gives_empty_output_and_the_initial_bank():
    layer = make_layer()
    y, state = layer(make_x(0), return_state=True)
    assert y.shape == (B, 0, D_MODEL)
    assert_close(state, layer.initial_state(B), rtol=0, atol=0, name="state after T = 0")


@pytest.mark.parametrize("decay", [True, False])
def test_gradients_reach_every_parameter(decay):
    layer = make_layer(use_decay=decay)
    x = make_x().requires_grad_()
    g = torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(2))
    (layer(x) * g).sum().backward()
    missing = [
        n
        for n, p in layer.named_parameters()
        if p.grad is None or not torch.isfinite(p.grad).all() or p.grad.abs().sum() == 0
    ]
    assert not missing, f"parameters without a finite non-zero gradient: {missing}"
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert (layer.decay_proj is not None) == decay


@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("split", [1, 16, 20])
def test_continuing_from_returned_state_equals_the_whole_sequence(decay, split):
    layer = make_layer(use_decay=decay)
    x = make_x()
    want = layer(x)
    y1, state = layer(x[:, :split], return_state=True)
    y2 = layer(x[:, split:], state=state)
    assert_close(torch.cat([y1, y2], 1), want, rtol=RTOL, name=f"y (split at {split})")


@pytest.mark.parametrize("decay", [True, False])
def test_step_token_by_token_equals_forward(decay):
    layer = make_layer(use_decay=decay)
    x = make_x()
    want, want_state = layer(x, return_state=True)
    state = layer.initial_state(B)
    got = torch.cat([layer.step_(x[:, t : t + 1], state) for t in range(T)], 1)
    assert not got.requires_grad
    assert_close(got, want, rtol=RTOL, name="y of step_")
    assert_close(state, want_state, rtol=RTOL, name="state after step_")


def test_step_after_a_prompt_in_blocks_equals_forward():
    layer = make_layer()
    x = make_x()
    want = layer(x)
    _, state = layer(x[:, :20], return_state=True)
    state = state.detach()
    got = [
        layer.step_(x[:, 20:29], state),
        layer.step_(x[:, 29:30], state),
        layer.step_(x[:, 30:], state),
    ]
    assert_close(torch.cat(got, 1), want[:, 20:], rtol=RTOL, name="y of step_ after a prompt")


@pytest.mark.parametrize("proj", ["q_proj", "v_proj", "b_proj", "decay_proj"])
def test_a_hook_on_a_projection_takes_effect(proj):
    """The projections run as one product of their weights; a hooked projection runs through
    its own forward instead: a hook doubling its output equals doubling its weight and bias
    (each layer's forward and the gradients of x)."""
    hooked, doubled = make_layer(), make_layer()
    getattr(hooked, proj).register_forward_hook(lambda m, args, out: out * 2)
    with torch.no_grad():
        for p in getattr(doubled, proj).parameters():
            p.mul_(2)
    results = []
    for layer in (hooked, doubled):
        x = make_x().requires_grad_()
        y = layer(x)
        y.square().sum().backward()
        results.append((y, x.grad))
    (y_hooked, gx_hooked), (y_doubled, gx_doubled) = results
    assert_close(y_hooked, y_doubled, rtol=RTOL, name=f"y with {proj} hooked")
    assert_close(gx_hooked, gx_doubled, rtol=RTOL, name=f"grad of x with {proj} hooked")
    assert (y_hooked - make_layer()(make_x())).abs().max() > 1e-3  # the hook changes y


def test_decay_off_equals_decay_of_one():
    """use_decay=False runs the recurrence without decay: the same as decays of exactly 1."""
    on, off = make_layer(use_decay=True), make_layer(use_decay=False)
    off.load_state_dict(
        {k: v for k, v in on.state_dict().items() if not k.startswith("decay_proj.")}
    )
    with torch.no_grad():
        on.decay_proj.weight.zero_()
        on.decay_proj.bias.fill_(100.0)  # sigmoid(100) == 1 in float32
    x = make_x()
    assert_close(on(x), off(x), rtol=RTOL, name="decay 1 against decay off")
    with torch.no_grad():
        on.decay_proj.bias.fill_(-2.0)
    assert (on(x) - off(x)).abs().max() > 1e-3, "a decay of sigmoid(-2) changed nothing"


@pytest.mark.parametrize(
    "option, value, error",
    [
        ("d_model", 0, ValueError),
        ("heads", 0, ValueError),
        ("head_dim", 24, ValueError),
        ("factors", (), ValueError),
        ("factors", (4, 5000), ValueError),
        ("factors", (2048, 1024), ValueError),
        ("read_topk", 0, ValueError),
        ("read_topk", 65, ValueError),
        ("write_topk", 0, ValueError),
        ("write_topk", 100, ValueError),
        ("chunk_size", 48, ValueError),
        ("snapshot", "fp16", ValueError),
        ("key_dim", 0, ValueError),
        # Of the wrong type:
        ("heads", 2.0, TypeError),
        ("factors", 16, TypeError),
        ("read_topk", True, TypeError),
        ("use_decay", 1, TypeError),
    ],
)
def test_bad_option_raises_naming_it(option, value, error):
    """A bad value raises ValueError, a value of the wrong type TypeError; either names the
    option."""
    opts = dict(SMALL_LAYER, d_model=D_MODEL) | {option: value}
    with pytest.raises(error, match=option):
        SparseDeltaMemory(**opts)


@pytest.mark.parametrize("shape", [(B, 2, 15, 16), (B + 1, 2, 16, 16), (2, 16, 16)])
def test_state_of_wrong_shape_raises_value_error_naming_state(shape):
    layer = make_layer()
    with pytest.raises(ValueError, match="state"):
        layer(make_x(), state=torch.zeros(shape))
    with pytest.raises(ValueError, match="state"):
        layer.step_(make_x(1), torch.zeros(shape))


def test_a_few_training_steps_lower_the_loss():
    """Regress a fixed target: eight AdamW steps lower the mean squared error."""
    layer = make_layer()
    x, target = make_x(seed=3), make_x(seed=4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.mse_loss(layer(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], f"losses did not fall: {losses}"


def test_packed_sequences_equal_each_sequence_alone_forward_and_gradients():
    layer = make_layer()
    lengths = [5, 0, 21, 11]
    xs = [
        torch.randn(1, n, D_MODEL, generator=torch.Generator().manual_seed(10 + i))
        for i, n in enumerate(lengths)
    ]
    cu = torch.tensor([0, 5, 5, 26, 37], dtype=torch.int32)
    packed = torch.cat(xs, 1).requires_grad_()
    y, state = layer(packed, return_state=True, cu_seqlens=cu)
    assert y.shape == (1, 37, D_MODEL) and state.shape == (4, 2, 16, 16)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((y * g).sum(), [packed, layer.v_proj.weight])
    alone = [x.clone().requires_grad_() for x in xs]
    outs = [layer(x, return_state=True) for x in alone]
    want_y = torch.cat([o[0] for o in outs], 1)
    want = torch.autograd.grad((want_y * g).sum(), [*alone, layer.v_proj.weight])
    assert_close(y, want_y, rtol=RTOL, name="y")
    assert_close(state, torch.cat([o[1] for o in outs]), rtol=RTOL, name="final states")
    assert_close(grads[0], torch.cat(want[:-1], 1), rtol=RTOL, name="dx")
    assert_close(grads[1], want[-1], rtol=RTOL, name="d v_proj.weight")
    # Decoding continues each sequence from its own state: one token for each.
    step = torch.randn(1, 4, D_MODEL, generator=torch.Generator().manual_seed(4))
    one = torch.arange(5, dtype=torch.int32)
    got = layer.step_(step, state.detach().clone(), cu_seqlens=one)
    for n in range(4):
        want_n = layer(step[:, n : n + 1], state=state[n : n + 1].detach())
        assert_close(got[:, n : n + 1], want_n, rtol=RTOL, name=f"step of sequence {n}")


@pytest.mark.parametrize(
    "x, error",
    [
        (torch.zeros(B, T, D_MODEL + 1), ValueError),
        (torch.zeros(T, D_MODEL), ValueError),
        ([[0.0] * D_MODEL], TypeError),
    ],
)
def test_bad_x_raises_naming_x(x, error):
    layer = make_layer()
    with pytest.raises(error, match="x must"):
        layer(x)
    with pytest.raises(error, match="x must"):
        layer.step_(x, layer.initial_state(B))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bfloat16])
def test_x_of_another_dtype_than_the_parameters_raises_type_error_naming_x(dtype):
    layer = make_layer()
    x = make_x().to(dtype)
    with pytest.raises(TypeError, match="x must have the layer's parameter dtype float32"):
        layer(x)
    with pytest.raises(TypeError, match="x must have the layer's parameter dtype float32"):
        layer.step_(x, layer.initial_state(B))


def test_x_on_another_device_than_the_parameters_raises_naming_x():
    layer = make_layer()
    with pytest.raises(ValueError, match="x is on meta"):
        layer(make_x().to("meta"))


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda s: s.double(), TypeError, "state must have dtype"),
        (lambda s: s.to(torch.int32), TypeError, "state must have dtype"),
        (lambda s: s.to("meta"), ValueError, "state is on meta"),
        (lambda s: s.tolist(), TypeError, "state must be a torch.Tensor"),
    ],
    ids=["float64", "int32", "meta", "list"],
)
def test_bad_state_is_reported_as_state_not_bank(make, error, text):
    layer = make_layer()
    x = make_x(5)
    with pytest.raises(error, match=text):
        layer(x, state=make(layer.initial_state(B)))
    with pytest.raises(error, match=text):
        layer.step_(x, make(layer.initial_state(B)))


def test_step_needs_a_contiguous_state_and_names_it():
    layer = make_layer()
    state = layer.initial_state(B).transpose(0, 1).contiguous().transpose(0, 1)
    before = state.clone()
    with pytest.raises(ValueError, match="state must be contiguous"):
        layer.step_(make_x(1), state)
    assert torch.equal(state, before)
    layer(make_x(1), state=state)  # forward does not write the state: any layout


@pytest.mark.parametrize("with_state", [False, True])
def test_cu_seqlens_as_a_list_raises_type_error_naming_it(with_state):
    layer = make_layer()
    x = make_x(5)[:1]
    state = layer.initial_state(2) if with_state else None
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        layer(x, state=state, cu_seqlens=[0, 2, 5])
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        layer.step_(x, layer.initial_state(2), cu_seqlens=[0, 2, 5])


def test_a_layer_on_the_meta_device_gives_meta_outputs_of_the_right_shapes():
    with torch.device("meta"):
        layer = SparseDeltaMemory(**OPTIONS)
        x = torch.empty(B, T, D_MODEL)
    y, state = layer(x, return_state=True)
    assert y.is_meta and state.is_meta
    assert y.shape == (B, T, D_MODEL) and state.shape == (B, 2, 16, 16)
    y1 = layer.step_(x[:, :1], state)
    assert y1.is_meta and y1.shape == (B, 1, D_MODEL)


@pytest.mark.parametrize("use_decay", [True, False])
def test_parameters_have_fla_style_projection_names(use_decay):
    layer = make_layer(use_decay=use_decay)
    assert layer.use_decay is use_decay
    names = {"q_proj", "k_proj", "v_proj", "b_proj", "o_proj"} | (
        {"decay_proj"} if use_decay else set()
    )
    assert {n for n, _ in layer.named_children()} == names
    assert {n for n, _ in layer.named_parameters(recurse=False)} == {"sub_keys", "bank"}
    assert all(isinstance(getattr(layer, n), torch.nn.Linear) for n in names)
    assert f"use_decay={use_decay}" in repr(layer)
    assert not hasattr(layer, "decay")


def test_the_old_decay_keyword_is_gone():
    with pytest.raises(TypeError, match="decay"):
        make_layer(decay=True)
