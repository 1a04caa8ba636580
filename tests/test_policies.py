"""Selective checkpointing policies, ``checkpoint_name`` and the ``checkpoint`` transform.

What is proved, each by exact quantities:

- gradients are bitwise equal (float64, dropout on) to the run without
  checkpointing, for every policy, on the example GPT and ResNet, and the
  region really was recomputed (its forward hooks ran twice);
- ``matmuls`` saves every op FlopCounterMode counts, so a step costs exactly the
  FLOPs of a step without checkpointing, while full recomputation costs more;
- the saved bytes are exactly the outputs the policy names: the matmul outputs,
  or the tensors tagged by ``checkpoint_name`` (hand-counted, JAX's seed example);
- every bad input is a ``ValueError`` naming the key as the user types it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import gpt_batch, resnet_batch, small_gpt, small_resnet
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ckpt_plugin._compat import hook_count
from ckpt_plugin.engine.functional import checkpoint
from ckpt_plugin.measure.memory import saved_bytes, step_flops
from ckpt_plugin.engine.selective.policies import SelectivePolicy, checkpoint_name, make_policy

aten = torch.ops.aten
F64 = 8  # bytes per float64 element

# --------------------------------------------------------------------------- helpers


def grads(model: nn.Module, run: Callable[[], torch.Tensor], seed: int = 5) -> list[torch.Tensor]:
    """Gradients of one step, model buffers (BatchNorm statistics) restored afterwards."""
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    run().backward()
    model.load_state_dict(buffers)
    return [p.grad.clone() for p in model.parameters()]


def assert_bitwise(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def count_forwards(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def tag_gpt(model: nn.Module) -> None:
    """Tag each block's attention output and MLP hidden layer (forward hooks may replace outputs)."""
    for block in model.blocks:
        block.attn.register_forward_hook(lambda m, i, out: checkpoint_name(out, "attn_y"))
        block.mlp.fc.register_forward_hook(lambda m, i, out: checkpoint_name(out, "mlp_h"))


def step(run: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def one() -> None:
        torch.manual_seed(5)
        run().backward()

    return one


def g(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.sin(W @ x)


def f4(W1, W2, W3, x):  # JAX's seed example: three layers, each output named
    x = checkpoint_name(g(W1, x), name="a")
    x = checkpoint_name(g(W2, x), name="b")
    return checkpoint_name(g(W3, x), name="c")


def jax_args(dtype=torch.float32) -> list[torch.Tensor]:
    shapes = [(5, 4), (6, 5), (7, 6), (4,)]
    return [torch.ones(s, dtype=dtype, requires_grad=True) for s in shapes]


JAX_INPUT_BYTES = (5 * 4 + 6 * 5 + 7 * 6 + 4) * 4  # W1, W2, W3, x in float32: 384


def function_saved_bytes(run: Callable[[], Any]) -> int:
    return saved_bytes(nn.Module(), run, owners=[]).total


# --------------------------------------------------------------------------- checkpoint_name


def test_checkpoint_name_outside_a_region_returns_the_tensor_itself():
    x = torch.randn(3, requires_grad=True)
    assert checkpoint_name(x, "a") is x


def test_checkpoint_name_is_identity_in_regions_that_do_not_go_by_names():
    x = torch.randn(3, requires_grad=True)
    same = []

    def fn(t):
        same.append(checkpoint_name(t, "a") is t)
        return t.sin()

    torch_checkpoint(fn, x, use_reentrant=False).sum().backward()  # full: forward and recompute
    torch_checkpoint(fn, x, use_reentrant=False, context_fn=make_policy("matmuls").context_fn).sum().backward()
    assert same == [True] * 4


def test_checkpoint_name_tags_inside_a_names_region():
    x = torch.randn(3, requires_grad=True)
    seen = []

    def fn(t):
        y = checkpoint_name(t * 2, "a")
        seen.append(y)
        return y.sin()

    policy = make_policy("names", save_names="a")
    torch_checkpoint(fn, x, use_reentrant=False, context_fn=policy.context_fn).sum().backward()
    assert policy.seen_names == {"a"}
    assert torch.equal(seen[0], x * 2)
    assert torch.equal(x.grad, 2 * torch.cos(2 * x))


# --------------------------------------------------------------------------- gradients


GPT_POLICIES = {
    "matmuls": dict(policy="matmuls"),
    "matmuls_no_batch": dict(policy="matmuls_no_batch"),
    "names": dict(policy="names", save_names=["attn_y"]),
    "names_exclude": dict(policy="names", exclude_names="mlp_h"),
    "op_list": dict(policy=["aten.mm", "addmm", "torch.ops.aten.bmm.default"]),
}


@pytest.mark.parametrize("keys", GPT_POLICIES.values(), ids=GPT_POLICIES.keys())
def test_gpt_gradients_bitwise_equal_whole_loss_checkpointed(keys):
    model = small_gpt(torch.float64)  # dropout 0.1 everywhere, attention included
    tag_gpt(model)
    batch = gpt_batch(model)
    plain = grads(model, lambda: model.loss(batch))
    calls = count_forwards(model.blocks[0])
    got = grads(model, lambda: checkpoint(model.loss, **keys)(batch))
    assert_bitwise(plain, got)
    assert calls == [2]  # forward and recomputation


@pytest.mark.parametrize("keys", GPT_POLICIES.values(), ids=GPT_POLICIES.keys())
def test_gpt_gradients_bitwise_equal_blocks_checkpointed(keys):
    model = small_gpt(torch.float64)
    tag_gpt(model)
    batch = gpt_batch(model)
    plain = grads(model, lambda: model.loss(batch))
    policy = make_policy(keys["policy"], save_names=keys.get("save_names"), exclude_names=keys.get("exclude_names"))
    for block in model.blocks:  # one region per block, one policy for all
        inner = block.forward
        block.forward = lambda x, inner=inner: torch_checkpoint(inner, x, use_reentrant=False, context_fn=policy.context_fn)
    calls = count_forwards(model.blocks[3].ln1)  # early in the block: recomputation stops early
    assert_bitwise(plain, grads(model, lambda: model.loss(batch)))
    assert calls == [2]
    if policy.uses_names:
        policy.check_names()
        # The hooks' tags, and the tags the example GPT carries itself.
        assert policy.seen_names == {"attn_y", "mlp_h", "attn_out", "mlp_hidden"}


RESNET_POLICIES = {
    "matmuls": dict(policy="matmuls"),
    "matmuls_no_batch": dict(policy="matmuls_no_batch"),
    "op_list": dict(policy=["convolution", "aten.addmm"]),
    "names": dict(policy="names", save_names="conv2"),
}


@pytest.mark.parametrize("keys", RESNET_POLICIES.values(), ids=RESNET_POLICIES.keys())
def test_resnet_gradients_bitwise_equal(keys):
    model = small_resnet(torch.float64)  # BatchNorm, Dropout2d
    for module in model.modules():
        if hasattr(module, "conv2"):
            module.conv2.register_forward_hook(lambda m, i, out: checkpoint_name(out, "conv2"))
    batch = resnet_batch(model, dtype=torch.float64)
    plain = grads(model, lambda: model.loss(batch))
    calls = count_forwards(model.stem)
    assert_bitwise(plain, grads(model, lambda: checkpoint(model.loss, **keys)(batch)))
    assert calls == [2]


def test_jax_seed_gradients_equal_with_names():
    args = jax_args(torch.float64)
    plain = torch.autograd.grad(f4(*args).sum(), args)
    for keys in (dict(save_names="a"), dict(exclude_names=["b"])):
        args = jax_args(torch.float64)
        got = torch.autograd.grad(checkpoint(f4, policy="names", **keys)(*args).sum(), args)
        assert_bitwise(list(plain), list(got))


def test_torch_sac_contexts_accept_the_policy_as_policy_fn():
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)
    plain = grads(model, lambda: model.loss(batch))
    policy = make_policy("matmuls")

    def run():
        return torch_checkpoint(model.loss, batch, use_reentrant=False,
                                context_fn=lambda: create_selective_checkpoint_contexts(policy))

    assert_bitwise(plain, grads(model, run))
    assert step_flops(step(run)) == step_flops(step(lambda: model.loss(batch)))


def test_second_backward_with_retain_graph_recomputes_correctly():
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)

    def twice(run):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = run()
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = twice(lambda: model.loss(batch))
    assert_bitwise(plain, twice(lambda: checkpoint(model.loss, policy="matmuls")(batch)))


def test_preserve_rng_state_false_changes_gradients():
    """The comparison above can fail: without RNG replay the recomputed dropout differs."""
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)
    plain = grads(model, lambda: model.loss(batch))
    got = grads(model, lambda: checkpoint(model.loss, policy="matmuls", preserve_rng_state=False)(batch))
    assert not all(torch.equal(p, q) for p, q in zip(plain, got))


def test_attention_is_saved_only_when_it_draws_no_random_numbers():
    policy = make_policy("matmuls")
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 1, 4, 2)
    assert policy.saves(op, (q, q, q, 0.0), {})
    assert policy.saves(op, (q, q, q), {})  # dropout_p defaults to 0
    assert not policy.saves(op, (q, q, q, 0.1), {})  # a saved random op would not be replayed
    assert not policy.saves(aten.sin.default, (q,), {})


# --------------------------------------------------------------------------- FLOPs


def test_gpt_flops_matmuls_equal_plain_and_full_recompute_costs_more():
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)
    plain = step_flops(step(lambda: model.loss(batch)))
    matmuls = step_flops(step(lambda: checkpoint(model.loss, policy="matmuls")(batch)))
    no_batch = step_flops(step(lambda: checkpoint(model.loss, policy="matmuls_no_batch")(batch)))
    full = step_flops(step(lambda: checkpoint(model.loss)(batch)))
    assert matmuls == plain  # every op FlopCounterMode counts is saved, none recomputed
    assert plain < no_batch < full  # attention's bmm recomputed, the projections not
    assert full / plain <= 4 / 3  # at most one more forward


def test_resnet_flops_matmuls_equal_plain():
    model = small_resnet(torch.float64)
    batch = resnet_batch(model, dtype=torch.float64)
    plain = step_flops(step(lambda: model.loss(batch)))
    assert step_flops(step(lambda: checkpoint(model.loss, policy="matmuls")(batch))) == plain
    assert step_flops(step(lambda: checkpoint(model.loss)(batch))) > plain


# --------------------------------------------------------------------------- saved bytes


def test_gpt_matmuls_saves_exactly_the_matmul_outputs_less_than_plain():
    model = small_gpt(torch.float64)  # 4 blocks, C=32, 2 heads, T=16, batch 2, vocab 96
    batch = gpt_batch(model)
    BT, C, BH, T, V = 2 * 16, 32, 2 * 2, 16, 96
    projections = BT * 3 * C + BT * C + BT * 4 * C + BT * C  # qkv, attn proj, fc, mlp proj: addmm
    attention = 2 * BH * T * T  # q @ k^T and att @ v: bmm (dropout on: the math path)
    head = BT * V  # mm
    saved = lambda run: saved_bytes(model, run, owners=[]).total  # noqa: E731
    with torch.random.fork_rng():
        plain = saved(lambda: model.loss(batch))
        matmuls = saved(lambda: checkpoint(model.loss, policy="matmuls")(batch))
        no_batch = saved(lambda: checkpoint(model.loss, policy="matmuls_no_batch")(batch))
        full = saved(lambda: checkpoint(model.loss)(batch))
    assert matmuls == (4 * (projections + attention) + head) * F64
    assert no_batch == (4 * projections + head) * F64
    assert full == 0  # the batch is a tuple: checkpoint keeps it by reference, nothing is packed
    assert 0 < no_batch < matmuls < plain


def test_gpt_gradients_bitwise_equal_under_bf16_autocast():
    model = small_gpt(torch.float32)
    batch = gpt_batch(model)

    def autocast(run):
        def under():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run()

        return under

    plain = grads(model, autocast(lambda: model.loss(batch)))
    assert_bitwise(plain, grads(model, autocast(lambda: checkpoint(model.loss, policy="matmuls")(batch))))


def two_tags(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(torch.tanh(x @ W), "h")  # (4, 8)
    z = checkpoint_name(torch.sigmoid(h @ W.T), "z")  # (4, 6)
    return (z * z).sum()


def test_names_saves_inputs_plus_exactly_the_named_tensors():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    W = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    inputs = (4 * 6 + 6 * 8) * F64
    h, z = 4 * 8 * F64, 4 * 6 * F64
    cases = {("h",): h, ("z",): z, ("h", "z"): h + z}
    for names, named in cases.items():
        assert function_saved_bytes(lambda: checkpoint(two_tags, policy="names", save_names=list(names))(x, W)) == inputs + named
    assert function_saved_bytes(lambda: checkpoint(two_tags, policy="names", exclude_names="h")(x, W)) == inputs + z
    assert function_saved_bytes(lambda: checkpoint(two_tags, policy="names", exclude_names="z")(x, W)) == inputs + h
    assert function_saved_bytes(lambda: checkpoint(two_tags)(x, W)) == inputs  # full recompute


def test_jax_seed_saved_residuals():
    """Seed 003: jax.checkpoint(f4, policy=save_only_these_names('a')) saves W1, W2, W3, x and a f32[5]."""
    args = jax_args()
    saved = lambda **keys: function_saved_bytes(lambda: checkpoint(f4, **keys)(*args))  # noqa: E731
    assert saved(policy="names", save_names="a") == JAX_INPUT_BYTES + 5 * 4
    assert saved(policy="names", exclude_names="a") == JAX_INPUT_BYTES + (6 + 7) * 4  # b and c
    # dots_with_no_batch_dims_saveable: the three dot_general outputs f32[5], f32[6], f32[7]
    assert saved(policy="matmuls_no_batch") == JAX_INPUT_BYTES + (5 + 6 + 7) * 4
    assert saved() == JAX_INPUT_BYTES


def test_saved_outputs_go_through_the_callers_saved_tensor_hooks(monkeypatch):
    """What a policy saves is offloaded like anything autograd saves (the hooks see it)."""
    from ckpt_plugin.engine.offload import Offloading, offloading

    monkeypatch.setattr(Offloading, "_in_host_memory", ())  # run the copy path on CPU
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    W = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    policy = make_policy("names", save_names="z")
    with offloading(min_bytes=0) as off:  # x and W are leaves: they stay
        loss = torch_checkpoint(two_tags, x, W, use_reentrant=False, context_fn=policy.context_fn)
    assert off.stats.moved_bytes == 4 * 6 * F64  # exactly z
    loss.backward()
    expected = torch.autograd.grad(two_tags(x, W), (x, W))
    assert torch.equal(x.grad, expected[0]) and torch.equal(W.grad, expected[1])


def test_offload_true_gives_equal_gradients(monkeypatch):
    from ckpt_plugin.engine.offload import Offloading

    monkeypatch.setattr(Offloading, "_in_host_memory", ())
    model = small_gpt(torch.float64)
    batch = gpt_batch(model)
    plain = grads(model, lambda: model.loss(batch))
    assert_bitwise(plain, grads(model, lambda: checkpoint(model.loss, policy="matmuls", offload=True)(batch)))


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("write", ["whole", "view", "copy"])
def test_a_saved_output_written_in_place_inside_the_region_is_saved_as_it_was(write: str, offload: bool, monkeypatch):
    """The region writes into an output the policy saves (HF Funnel adds to its attention scores): the policy keeps
    its value from before the write, the recomputation writes into it again, and gradients are bitwise those without
    checkpointing. Offloaded (on CPU, as if to host memory: the hook's copy is made at the save), the copy has it."""
    from ckpt_plugin.engine.offload import Offloading

    monkeypatch.setattr(Offloading, "_in_host_memory", ())
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)  # 1 KiB: moved

    def fn(t):
        h = t @ t
        if write == "whole":
            h.mul_(2)
        elif write == "view":
            h[:, :8].add_(1)  # through a view: the same storage
        else:
            h.copy_(t.sin())  # all of it, from elsewhere
        return (h.tanh() @ t).sum()

    (expected,) = torch.autograd.grad(fn(x), x)
    (got,) = torch.autograd.grad(checkpoint(fn, policy="matmuls", offload=offload)(x), x)
    assert torch.equal(got, expected)


def test_in_place_write_after_the_region_to_a_saved_output_is_an_error():
    x = torch.randn(4, 4, requires_grad=True)
    h = checkpoint(lambda t: (t @ t).sin() @ t, policy="matmuls")(x)  # the region returns a saved output
    h.mul_(2)
    with pytest.raises(RuntimeError, match=r"saved the output of aten.mm.default and it was then modified in place"):
        h.sum().backward()


# --------------------------------------------------------------------------- the transform


def test_decorator_forms_and_wraps():
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def layer(t):
        """doc"""
        return torch.sin(t @ t)

    @checkpoint
    def bare(t):
        return torch.sin(t @ t)

    @checkpoint(policy="matmuls")
    def with_policy(t):
        return torch.sin(t @ t)

    expected = torch.autograd.grad(layer(x).sum(), x)[0]
    for fn in (checkpoint(layer), checkpoint(layer, policy="matmuls_no_batch"), bare, with_policy):
        assert torch.equal(torch.autograd.grad(fn(x).sum(), x)[0], expected)
    wrapped = checkpoint(layer, policy="matmuls")
    assert wrapped.__name__ == "layer" and wrapped.__doc__ == "doc" and wrapped.__wrapped__ is layer


def test_keyword_arguments_reach_fn_even_with_checkpoints_own_names():
    x = torch.randn(3, requires_grad=True)

    def fn(t, *, context_fn, use_reentrant):
        return t * context_fn * use_reentrant

    out = checkpoint(fn, policy="matmuls")(x, context_fn=2.0, use_reentrant=3.0)
    assert torch.equal(out, x * 6.0)


def test_names_are_checked_only_after_a_call_that_records_gradients():
    x = torch.randn(4, 6, requires_grad=True)
    W = torch.randn(6, 8, requires_grad=True)
    fn = checkpoint(two_tags, policy="names", save_names="hh")
    with torch.no_grad():
        fn(x, W)  # nothing checkpointed, nothing seen, nothing to judge
    with pytest.raises(ValueError, match=r"^ckpt.save_names: no checkpoint_name in the model uses 'hh'; names used: h, z$"):
        fn(x, W)


# --------------------------------------------------------------------------- bad input


def test_unknown_policy_lists_policies_closest_first():
    with pytest.raises(ValueError, match=r"ckpt.policy='matmul' is not a policy; valid policies, closest first: matmuls, matmuls_no_batch, names"):
        make_policy("matmul")


def test_policy_of_wrong_type():
    with pytest.raises(ValueError, match=r"ckpt.policy=3 \(int\) must be one of matmuls, matmuls_no_batch, names"):
        make_policy(3)


def test_unknown_op_lists_closest_aten_ops():
    with pytest.raises(ValueError, match=r"ckpt.policy: unknown op 'aten.adddmm'; closest aten ops: addmm, "):
        make_policy(["aten.mm", "aten.adddmm"])


def test_unknown_overload_lists_overloads():
    with pytest.raises(ValueError, match=r"ckpt.policy: aten.mm has no overload 'defalt'; its overloads: default"):
        make_policy(["aten.mm.defalt"])


def test_in_place_op_cannot_be_saved():
    with pytest.raises(ValueError, match=r"ckpt.policy: 'aten.add_' writes into its input"):
        make_policy(["aten.add_"])


def test_view_op_cannot_be_saved():
    with pytest.raises(ValueError, match=r"ckpt.policy: 'transpose' returns a view of its input"):
        make_policy(["transpose"])


def test_random_op_cannot_be_saved():
    with pytest.raises(ValueError, match=r"ckpt.policy: 'native_dropout' draws random numbers"):
        make_policy(["native_dropout"])


def test_empty_op_list():
    with pytest.raises(ValueError, match=r"ckpt.policy=\[\] names no ops"):
        make_policy([])


def test_policy_name_inside_an_op_list():
    with pytest.raises(ValueError, match=r"ckpt.policy: 'matmuls' is a policy, not an op: write ckpt.policy=matmuls"):
        make_policy(["matmuls"])


def test_non_string_op_name():
    with pytest.raises(ValueError, match=r"ckpt.policy: op names must be strings, got 7"):
        make_policy(["mm", 7])


def test_names_policy_without_names():
    with pytest.raises(ValueError, match=r"ckpt.policy=names needs ckpt.save_names .* or ckpt.exclude_names"):
        make_policy("names")


def test_save_names_and_exclude_names_both_set():
    with pytest.raises(ValueError, match=r"ckpt.save_names and ckpt.exclude_names are both set"):
        make_policy("names", save_names="a", exclude_names="b")


def test_names_without_policy_names():
    with pytest.raises(ValueError, match=r"^ckpt.save_names needs ckpt.policy=names, got ckpt.policy='matmuls'$"):
        make_policy("matmuls", save_names=["a"])


def test_exclude_names_without_any_policy():
    with pytest.raises(ValueError, match=r"^ckpt.exclude_names needs ckpt.policy=names, got ckpt.policy=None$"):
        checkpoint(two_tags, exclude_names="h")


def test_empty_name():
    with pytest.raises(ValueError, match=r"ckpt.save_names=\['a', ''\]: give one or more non-empty names"):
        make_policy("names", save_names=["a", ""])


def test_names_of_wrong_type():
    with pytest.raises(ValueError, match=r"ckpt.exclude_names=5 \(int\) must be a name or a list of names"):
        make_policy("names", exclude_names=5)


def test_several_problems_reported_together():
    with pytest.raises(ValueError, match=r"2 problems") as err:
        make_policy(["mmm", "view"])
    assert "unknown op 'mmm'" in str(err.value) and "'view' returns a view" in str(err.value)


def test_unseen_save_name_lists_names_used_closest_first():
    policy = make_policy("names", save_names=["attn"])
    policy.seen_names |= {"mlp_h", "attn_y"}
    with pytest.raises(ValueError, match=r"^ckpt.save_names: no checkpoint_name in the model uses 'attn'; names used: attn_y, mlp_h$"):
        policy.check_names()


def test_unseen_exclude_name():
    policy = make_policy("names", exclude_names=["b", "zz"])
    policy.seen_names |= {"b"}
    with pytest.raises(ValueError, match=r"^ckpt.exclude_names: no checkpoint_name in the model uses 'zz'; names used: b$"):
        policy.check_names()


def test_seen_names_are_recorded_in_the_model():
    model = small_gpt(torch.float64, n_layer=1)
    tag_gpt(model)
    fn = checkpoint(model.loss, policy="names", save_names=["attn_y", "mlp"])
    with pytest.raises(ValueError, match=r"^ckpt.save_names: no checkpoint_name in the model uses 'mlp'; names used: mlp_h, mlp_hidden, attn_out, attn_y$"):
        fn(gpt_batch(model))


def test_bad_policy_fails_at_the_decorator():
    with pytest.raises(ValueError, match=r"ckpt.policy='dots' is not a policy"):
        checkpoint(policy="dots")


def test_checkpoint_of_a_non_function():
    with pytest.raises(TypeError, match=r"checkpoint expects a function to transform, got int"):
        checkpoint(3)


def test_preserve_rng_state_must_be_a_bool():
    with pytest.raises(ValueError, match=r"ckpt.preserve_rng_state='yes' \(str\) must be true or false"):
        checkpoint(two_tags, preserve_rng_state="yes")


def test_checkpoint_name_needs_a_name():
    with pytest.raises(ValueError, match=r"checkpoint_name: the name must be a non-empty string, got ''"):
        checkpoint_name(torch.ones(1), "")


def test_policy_repr():
    assert repr(make_policy("names", save_names="a")) == "SelectivePolicy('names', save_names=('a',))"
    assert isinstance(make_policy(["mm"]), SelectivePolicy)


# --------------------------------------------------------------------------- names checked in the Python API


def _names_model(**names: Any) -> nn.Module:
    from ckpt_plugin import apply_checkpointing

    model = small_gpt()
    apply_checkpointing(model, mode="selective", layers="TransformerBlock", policy="names", **names)
    return model


def test_apply_checkpointing_raises_for_an_unknown_name_in_the_first_backward():
    # What the callback and checkpoint() already do: a typo in save_names never trains silently.
    model = _names_model(save_names=["atn_out"])
    x = model.example_input_array
    with torch.no_grad():  # no checkpointed forward (validation): nothing to judge
        model(x)
    loss = model(x).sum()  # the first training step: its forward has tagged every name it uses
    message = r"^ckpt.save_names: no checkpoint_name in the model uses 'atn_out'; names used: attn_out, mlp_hidden$"
    with pytest.raises(ValueError, match=message):
        loss.backward()
    model(x).sum().backward()  # checked once, as the callback does: the model still trains


def test_apply_checkpointing_with_names_in_use_trains_and_leaves_nothing_on_the_model():
    from ckpt_plugin import remove_checkpointing

    hooks = hook_count(small_gpt())
    model = _names_model(exclude_names=["mlp_hidden"])
    assert hook_count(model) == hooks  # the check lives with the policy: remove restores exactly
    model(model.example_input_array).sum().backward()
    assert remove_checkpointing(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def test_apply_checkpointing_checks_names_under_segments_too():
    model = _names_model(save_names=["attn_out", "mlp"], segments=2)
    loss = model(model.example_input_array).sum()
    # The names used, closest first.
    with pytest.raises(ValueError, match=r"^ckpt.save_names: no checkpoint_name in the model uses 'mlp'; names used: "
                                         r"mlp_hidden, attn_out$"):
        loss.backward()
