"""``saved_activations``: exact rows of what autograd keeps, against hand counts, JAX's seed 004 and ``measure``.

Every call runs on fake tensors (the default); the last section checks that
the rows are those of real tensors, exactly, on the examples and a Hugging Face GPT-2.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpt_batch, resnet_batch, small_gpt, small_resnet
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_plugin import apply_checkpointing, checkpoint, checkpoint_name
from ckpt_plugin.measure.memory import saved_bytes
from ckpt_plugin.measure.residuals import SavedRow, saved_activations

F32 = torch.float32


def rows(report) -> list[tuple[str, tuple[int, ...], int]]:
    return [(r.source, r.shape, r.bytes) for r in report.rows]


def leaf(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, requires_grad=True)


# ---------------------------------------------------------------------- hand counts


def test_sin_keeps_its_input_exactly() -> None:
    def sine(x):
        return torch.sin(x)

    report = saved_activations(sine, leaf(5, 4))
    assert report.rows == [SavedRow("argument x", (5, 4), F32, 80)]
    assert (report.total_bytes, report.parameter_bytes) == (80, 0)


def test_mm_keeps_both_inputs() -> None:
    def matmul(a, b):
        return a @ b

    assert rows(saved_activations(matmul, leaf(3, 4), b=leaf(4, 5))) == [
        ("argument a", (3, 4), 48),
        ("argument b", (4, 5), 80),
    ]


def test_a_storage_saved_by_two_ops_counts_once() -> None:
    def f(x):  # exp saves its result, sin saves its input: the same tensor
        return torch.sin(torch.exp(x))

    report = saved_activations(f, leaf(5, 4))
    assert rows(report) == [("output of aten.exp in f", (5, 4), 80)]
    assert report.rows[0].dtype == F32


def test_a_view_and_its_base_count_once_at_the_base_size() -> None:
    def f(x, w):
        h = x.exp()  # exp saves h; mm saves h.t(), a view of it
        return h.t() @ w

    x, w = leaf(4, 3), leaf(4, 2)
    report = saved_activations(f, x, w)
    assert rows(report) == [("argument w", (4, 2), 32), ("output of aten.exp in f", (4, 3), 48)]
    assert report.total_bytes == saved_bytes(nn.Module(), lambda: f(x, w), []).total == 80

    def tail(x):  # sin keeps x[1:], a view: the whole storage of x stays alive
        return x[1:].sin()

    assert rows(saved_activations(tail, leaf(5, 4))) == [("argument x", (5, 4), 80)]


def test_arguments_are_named_through_containers_and_closures_apart() -> None:
    c = leaf(3)

    def f(pair, scale):
        return (pair[0] * pair[1]).sum() * scale["s"] + (pair[0] * c).sum()

    report = saved_activations(f, (leaf(3), leaf(3)), {"s": leaf(1)})
    sources = [r.source for r in report.rows]
    assert sources[:3] == ["argument pair[0]", "argument pair[1]", "argument scale['s']"]
    assert "tensor made outside f" in sources


def test_nothing_requiring_grad_keeps_nothing_and_says_why() -> None:
    report = saved_activations(torch.sin, torch.ones(3))
    assert report.rows == [] and report.total_bytes == 0
    assert "does not require grad" in str(report)


# ---------------------------------------------------------------------- seed 004, f(W1, W2, W3, x)

# jax.ad_checkpoint.print_saved_residuals on the seed's f, jax.checkpoint(g) per layer (f2),
# dots_with_no_batch_dims_saveable (f3) and save_only_these_names('a') (f4): (shape, source).
JAX_ARGS = [("f32[5,4]", "argument W1"), ("f32[6,5]", "argument W2"), ("f32[7,6]", "argument W3"), ("f32[4]", "argument x")]
JAX_PLAIN = ["f32[5]", "f32[5]", "f32[6]", "f32[6]", "f32[7]"]  # sin, cos, sin, cos, cos
JAX_F2 = ["f32[5]", "f32[6]"]  # the outputs of sin that feed the next checkpointed g
JAX_F3 = ["f32[5]", "f32[6]", "f32[7]"]  # dot_general
JAX_F4 = ["f32[5]"]  # named 'a'


def g(W, x):
    return torch.sin(W @ x)


def f(W1, W2, W3, x):
    x = g(W1, x)
    x = g(W2, x)
    x = g(W3, x)
    return x


def f2(W1, W2, W3, x):
    x = checkpoint(g)(W1, x)
    x = checkpoint(g)(W2, x)
    x = checkpoint(g)(W3, x)
    return x


def f4(W1, W2, W3, x):
    x = checkpoint_name(g(W1, x), name="a")
    x = checkpoint_name(g(W2, x), name="b")
    x = checkpoint_name(g(W3, x), name="c")
    return x


def seed_args(parameters: bool = False) -> list[torch.Tensor]:
    make = (lambda *s: nn.Parameter(torch.ones(*s))) if parameters else leaf
    return [make(5, 4), make(6, 5), make(7, 6), leaf(4)]


def short(report) -> list[tuple[str, str]]:
    return [(f"f32[{','.join(map(str, r.shape))}]", r.source) for r in report.rows]


def test_seed_plain_keeps_what_jax_keeps_shape_for_shape() -> None:
    report = saved_activations(f, *seed_args())
    # torch keeps sin's input (the mv output) where JAX keeps cos: the same shapes, the same bytes.
    assert short(report) == JAX_ARGS + [
        ("f32[5]", "output of aten.mv in g"),
        ("f32[5]", "output of aten.sin in g"),
        ("f32[6]", "output of aten.mv in g"),
        ("f32[6]", "output of aten.sin in g"),
        ("f32[7]", "output of aten.mv in g"),
    ]
    assert [s for s, _ in short(report)[4:]] == JAX_PLAIN
    assert report.total_bytes == 4 * (20 + 30 + 42 + 4 + 5 + 5 + 6 + 6 + 7) == 500


def test_seed_checkpointed_keeps_only_the_arguments() -> None:
    assert short(saved_activations(checkpoint(f), *seed_args())) == JAX_ARGS
    # W1..W3 as parameters: the same rows, marked apart and out of the total.
    report = saved_activations(checkpoint(f), *seed_args(parameters=True))
    assert short(report) == JAX_ARGS
    assert [r.is_parameter for r in report.rows] == [True, True, True, False]
    assert (report.total_bytes, report.parameter_bytes) == (16, 4 * (20 + 30 + 42))


def test_seed_checkpoint_per_layer_keeps_the_inputs_of_each_region() -> None:
    report = saved_activations(f2, *seed_args())
    assert short(report) == JAX_ARGS + [("f32[5]", "input of checkpointed g"), ("f32[6]", "input of checkpointed g")]
    assert [s for s, _ in short(report)[4:]] == JAX_F2


def test_seed_policies_keep_what_the_jax_policies_keep() -> None:
    dots = saved_activations(checkpoint(f, policy="matmuls_no_batch"), *seed_args())
    assert short(dots)[4:] == [(s, "output of aten.mv in g") for s in JAX_F3]
    named = saved_activations(checkpoint(f4, policy="names", save_names=["a"]), *seed_args())
    assert short(named) == JAX_ARGS + [(JAX_F4[0], "named 'a' in f4")]


def test_torch_non_reentrant_checkpoint_region_inputs_are_attributed() -> None:
    def outer(W, x):
        h = x + 1  # add saves nothing: h is kept only as the region's input
        return torch_checkpoint(g, W, h, use_reentrant=False)

    assert rows(saved_activations(outer, leaf(5, 4), leaf(4))) == [
        ("argument W", (5, 4), 80),
        ("input of checkpointed g", (4,), 16),
    ]


# ---------------------------------------------------------------------- modules

B, T, C = 2, 16, 32  # small_gpt's batch, block_size, n_embd


@pytest.fixture
def gpt():
    model = small_gpt(n_layer=2)
    return model, gpt_batch(model)


def test_module_rows_come_from_module_paths_and_parameters_stand_apart(gpt) -> None:
    model, (idx, _) = gpt
    report = saved_activations(model, idx)
    paths = {n or "GPT" for n, _ in model.named_modules()}
    params = dict(model.named_parameters())
    for r in report.rows:
        kind, _, name = r.source.partition(" ")
        if r.is_parameter:
            assert kind == "parameter" and tuple(params[name].shape) == r.shape
        elif kind != "argument":
            assert kind in paths, r.source
    assert rows(report)[0] == ("argument idx", (B, T), B * T * 8)
    # gelu keeps its input: fc's addmm output, a (B*T, 4C) matrix.
    assert ("blocks.0.mlp.fc aten.addmm", (B * T, 4 * C), B * T * 4 * C * 4) in rows(report)
    assert ("parameter blocks.0.attn.qkv.weight", (3 * C, C), 3 * C * C * 4) in rows(report)
    assert report.total_bytes == saved_bytes(model, lambda: model(idx), []).total
    assert report.parameter_bytes == sum(r.bytes for r in report.rows if r.source.startswith("parameter "))


def test_checkpointed_blocks_show_only_their_inputs_plus_the_rest(gpt) -> None:
    model, (idx, _) = gpt
    plain = saved_activations(model, idx)
    blocks = apply_checkpointing(model, layers="TransformerBlock")
    ckpt = saved_activations(model, idx)
    inputs = [r for r in ckpt.rows if r.source.startswith("input of checkpointed ")]
    assert [(r.source, r.shape, r.bytes) for r in inputs] == [
        (f"input of checkpointed {b}", (B, T, C), B * T * C * 4) for b in blocks
    ]
    # Nothing from inside a block, and no block parameter, is kept: the regions recompute them.
    inside = [r.source for r in ckpt.rows if r.source.startswith("blocks.")]
    assert inside == [f"{blocks[-1]} aten.add"]  # the last block's output, ln_f's input
    assert not any(r.source.startswith("parameter blocks.") for r in ckpt.rows)

    def rest(report):
        outside = (r for r in report.rows if not r.is_parameter and not r.source.startswith(("blocks.", "input of")))
        return {(r.source, r.shape, r.bytes) for r in outside}

    # The rest is as without checkpointing, less blocks.0's input, now kept for its region.
    assert rest(plain) - rest(ckpt) == {("drop aten.mul", (B, T, C), B * T * C * 4)}
    assert ckpt.total_bytes == saved_bytes(model, lambda: model(idx), []).total
    assert ckpt.total_bytes < plain.total_bytes / 5


def test_segments_and_bound_methods(gpt) -> None:
    model, batch = gpt
    apply_checkpointing(model, layers="TransformerBlock", segments=1)
    report = saved_activations(model.loss, batch)
    sources = [r.source for r in report.rows]
    assert sources[:2] == ["argument batch[0]", "argument batch[1]"]
    assert "input of checkpointed segment from blocks.0" in sources
    assert "output of aten._log_softmax in GPT.loss" in sources  # cross_entropy runs outside any module
    assert report.total_bytes == saved_bytes(model, lambda: model.loss(batch), []).total


def test_a_module_called_by_a_plain_function_is_named_by_its_class() -> None:
    lin = nn.Linear(4, 3)
    report = saved_activations(lambda x: lin(x).relu(), leaf(2, 4))
    assert rows(report) == [
        ("argument x", (2, 4), 32),
        ("parameter Linear.weight", (3, 4), 48),  # addmm saves it for x's gradient
        ("output of aten.relu in <lambda>", (2, 3), 24),
    ]
    assert [r.is_parameter for r in report.rows] == [False, True, False]


def test_the_forward_leaves_rng_buffers_and_global_hooks_alone() -> None:
    model = small_resnet()
    x, _ = resnet_batch(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    report = saved_activations(model, x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
    # BatchNorm keeps its running statistics for backward: buffers, marked apart with the parameters.
    assert any(r.is_parameter and r.source == "buffer stem.1.running_mean" for r in report.rows)
    assert report.total_bytes == saved_bytes(model, lambda: model(x), []).total  # draws dropout masks
    rng = torch.get_rng_state()

    def broken(x):
        model(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        saved_activations(broken, x)
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
    assert torch.equal(torch.get_rng_state(), rng)


def test_not_a_function_is_an_error() -> None:
    with pytest.raises(TypeError, match="function or module to run, got Tensor"):
        saved_activations(torch.ones(2))


# ---------------------------------------------------------------------- the table


def test_str_is_an_aligned_table_with_a_header_and_totals(gpt) -> None:
    report = saved_activations(f, *seed_args())
    lines = str(report).splitlines()
    assert lines[0] == "saved_activations(f): what autograd keeps for backward after one forward"
    assert lines[1].split() == ["saved", "bytes", "source"]
    assert lines[2].split() == ["f32[5,4]", "80", "B", "argument", "W1"]
    assert lines[-1].split() == ["total", "500", "B", "9", "tensor(s)"]
    column = lines[1].index("source")
    assert [line.index(r.source) for line, r in zip(lines[2:-1], report.rows)] == [column] * len(report.rows)

    model, (idx, _) = gpt
    report = saved_activations(model, idx)
    text = str(report)
    assert f"({report.total_bytes:,} B)" in text
    assert "model state, kept anyway (not in the total):" in text
    assert "parameter head.weight" in text and text.splitlines()[-1].lstrip().startswith("parameters")


# ---------------------------------------------------------------------- fake tensors, as real ones


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(64, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :4] = 0  # left padding, as HF users batch prompts of different lengths
    return model, ids, mask


def _workload(name: str):
    """(function or module, args, kwargs) to measure: the seed's functions, the examples, GPT-2 as HF users call it."""
    if name.startswith("seed"):
        fn = {"seed": f, "seed-per-layer": f2, "seed-names": checkpoint(f4, policy="names", save_names=["a"])}[name]
        return fn, seed_args(parameters=name == "seed-names"), {}
    if name == "view":  # a view of an argument: its (fake) copy is the argument's storage
        return (lambda x, w: x.exp().t() @ w + x[1:].sin().sum()), [leaf(4, 3), leaf(4, 2)], {}
    if name == "resnet":
        model = small_resnet()
        return model, [resnet_batch(model)[0]], {}
    if name.startswith("gpt2"):
        model, ids, mask = _gpt2()
        if name == "gpt2-blocks":
            apply_checkpointing(model, layers="GPT2Block")
        return model, [], {"input_ids": ids, "attention_mask": mask, "labels": ids}
    model = small_gpt(n_layer=2)
    batch = gpt_batch(model)
    if name == "gpt-blocks":
        apply_checkpointing(model, layers="TransformerBlock")
    if name == "gpt-segment":
        apply_checkpointing(model, layers="TransformerBlock", segments=1)
    if name == "gpt-linear":  # a module called by a plain function: named, and its state adopted, on the fly
        return (lambda x: model.head(model.ln_f(x)).relu()), [leaf(B, T, C)], {}
    return (model.loss, [batch], {}) if name != "gpt" else (model, [batch[0]], {})


FAKE_AS_REAL = ["seed", "seed-per-layer", "seed-names", "view", "gpt", "gpt-blocks", "gpt-segment", "gpt-linear",
                "resnet", "gpt2", "gpt2-blocks"]


@pytest.mark.parametrize("name", FAKE_AS_REAL)
def test_fake_tensors_give_the_rows_and_table_of_real_ones(name) -> None:
    fn, args, kwargs = _workload(name)
    real = saved_activations(fn, *args, fake=False, **kwargs)
    fake = saved_activations(fn, *args, **kwargs)
    assert fake.rows == real.rows  # source, shape, dtype, bytes, is_parameter: row by row
    assert str(fake) == str(real)
    assert fake.total_bytes > 0


def test_gpt2_with_an_all_ones_mask_keeps_the_mask_on_fake_tensors_only() -> None:
    """transformers drops an all-ones mask (SDPA's is_causal instead), a decision on values: on a
    FakeTensor it keeps the mask (``masking_utils``: ``is_tracing``). Checkpointed blocks then
    keep it as an input, one (B, 1, T, T) bool tensor: the only row by which fake and real differ."""
    model, ids, _ = _gpt2()
    apply_checkpointing(model, layers="GPT2Block")
    call = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long), "labels": ids}
    real = saved_activations(model, fake=False, **call)
    fake = saved_activations(model, **call)
    extra = [r for r in fake.rows if r not in real.rows]
    assert extra == [SavedRow("input of checkpointed transformer.h.0", (B, 1, T, T), torch.bool, B * T * T)]
    assert [r for r in fake.rows if r not in extra] == real.rows


def test_a_forward_that_reads_values_runs_on_fake_tensors_replaying_what_it_read() -> None:
    def branchy(x):
        return x.sin() if x.sum().item() > 0 else x[x > 0.5].cos()

    for x in (leaf(5, 4), -leaf(5, 4)):
        assert rows(saved_activations(branchy, x)) == rows(saved_activations(branchy, x, fake=False))
    assert rows(saved_activations(branchy, leaf(5, 4))) == [("argument x", (5, 4), 80)]
