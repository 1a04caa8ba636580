"""Plans you can keep (``planning/plan_file.py``, ``ckpt.plan``): a plan written to JSON and given back installs
exactly what the original installs, and a plan that does not fit the model it is given back to is refused.

Each round trip installs the original plan and the loaded one on the same model in turn: the same wrapped
names, and bitwise the same gradients of a step with dropout on (same seed). The plans cover every kind a
file holds: full, selective (matmuls, an op list, names), offload, segments (a count, and rotor's nested
regions), and ckpt=auto below what one option per layer reaches, so parts inside the layers (and, on the
ResNet, op groups: ``regroup``) are wrapped.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import gpt_batch, resnet_batch, small_gpt, small_resnet

from ckpt_plugin import remove_checkpointing, wrapped_modules
from ckpt_plugin.apply.install import apply_checkpointing
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.plan import EachLayer, WrapPlan
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import install
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.planning.planner import smallest_peak
from ckpt_plugin.planning.plan_file import FORMAT, load_plan, plan_to_dict, save_plan
from ckpt_plugin.planning.profile import INSIDE_DEPTH, profile, wrap_plan

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt() -> dict:
    model = small_gpt(n_layer=2, n_embd=32, block_size=16)
    batch = gpt_batch(model)
    return {"model": model, "batch": batch, "forward": lambda: model.loss(batch)}


def _installed(model, plan: WrapPlan, forward) -> tuple[list[str], list[str], dict[str, torch.Tensor]]:
    """(names install returns, wrapped_modules, gradients of one seeded step) with ``plan`` on; left unwrapped."""
    names = install(model, plan)
    try:
        wrapped = wrapped_modules(model)
        torch.manual_seed(0)
        forward().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        remove_checkpointing(model)
        model.zero_grad(set_to_none=True)
    return names, wrapped, grads


def _round_trip(model, plan: WrapPlan, forward, path) -> WrapPlan:
    save_plan(plan, path, model)
    loaded = load_plan(path, model)
    assert plan_to_dict(loaded, model) == json.loads(path.read_text())  # nothing lost in the loaded plan
    names, wrapped, grads = _installed(model, plan, forward)
    again, wrapped_again, grads_again = _installed(model, loaded, forward)
    assert names == again and wrapped == wrapped_again and names
    assert grads.keys() == grads_again.keys()
    assert all(torch.equal(grads[n], grads_again[n]) for n in grads), [n for n in grads
                                                                      if not torch.equal(grads[n], grads_again[n])]
    return loaded


KEYS = {
    "full": dict(layers="TransformerBlock"),
    "selective_matmuls": dict(mode="selective", layers="TransformerBlock", policy="matmuls"),
    "selective_ops": dict(mode="selective", layers="TransformerBlock", policy=["aten.mm", "addmm"]),
    "selective_names": dict(mode="selective", layers="TransformerBlock", policy="names", save_names=["attn_out"]),
    "offload": dict(mode="offload", layers="TransformerBlock"),
    "segments": dict(layers="TransformerBlock", segments=2),
    "optimal": dict(layers="TransformerBlock", segments="optimal", budget=0.5),
}


@pytest.mark.parametrize("name", list(KEYS))
def test_a_saved_plan_installs_what_the_original_installs(gpt: dict, name: str, tmp_path) -> None:
    model = gpt["model"]
    plan = plan_for(model, make_config(**KEYS[name]), gpt["forward"])
    loaded = _round_trip(model, plan, gpt["forward"], tmp_path / "plan.json")
    treatment = loaded.groups[0].treatment
    if name.startswith("selective"):
        assert repr(treatment.policy) == repr(plan.groups[0].treatment.policy)
    if name == "optimal":
        assert loaded.groups[0].segments == plan.groups[0].segments and isinstance(loaded.groups[0].segments, tuple)
        assert loaded.planned == plan.planned  # rotor's Solution, its nested regions included


def test_an_auto_plan_inside_the_layers_round_trips(gpt: dict, tmp_path) -> None:
    """Parts checkpointed inside the blocks (nested under full ones, or in an unwrapped block)."""
    model, forward = gpt["model"], gpt["forward"]
    deep = profile(model, ["blocks.0", "blocks.1"], forward, depth=INSIDE_DEPTH)
    chosen = deep.plan(smallest_peak(deep.layers, deep.rest_running))
    plan = wrap_plan(chosen)
    assert set(plan.names) - {"blocks.0", "blocks.1"}  # parts wrapped
    loaded = _round_trip(model, plan, forward, tmp_path / "plan.json")
    assert loaded.planned == chosen  # the planner's record: choices, predicted peak and time


def test_an_auto_plan_with_op_groups_round_trips(tmp_path) -> None:
    """The ResNet's blocks run as op groups (``regroup``): the file names the groups, made again on loading."""
    model = small_resnet(depths=(1, 1))
    batch = resnet_batch(model)
    forward = lambda: model.loss(batch)  # noqa: E731
    deep = profile(model, ["stages.0.0", "stages.1.0"], forward, depth=INSIDE_DEPTH)
    plan = wrap_plan(deep.plan(smallest_peak(deep.layers, deep.rest_running)), regrouped=deep.regrouped)
    assert plan.regroup
    saved = plan_to_dict(plan, model)
    assert "OpGroup" in saved["modules"].values()
    _round_trip(model, plan, forward, tmp_path / "plan.json")


def test_equal_treatments_stay_one_object(gpt: dict, tmp_path) -> None:
    """The planner shares one treatment (and one policy) between the layers of an option; so does a loaded plan."""
    model = gpt["model"]
    shared = Treatment()
    plan = WrapPlan((EachLayer(("blocks.0",), shared), EachLayer(("blocks.1",), shared)))
    loaded = load_plan(save_plan(plan, tmp_path / "plan.json", model), model)
    assert loaded.groups[0].treatment is loaded.groups[1].treatment


def test_apply_checkpointing_installs_a_plan_file(gpt: dict, tmp_path) -> None:
    model = gpt["model"]
    plan = plan_for(model, make_config(mode="selective", layers="blocks.1"))
    path = save_plan(plan, tmp_path / "plan.json", model)
    try:
        assert apply_checkpointing(model, mode="auto", plan=str(path)) == ["blocks.1"]
    finally:
        remove_checkpointing(model)


# ---------------------------------------------------------------------- refusals


def _saved(gpt: dict, tmp_path) -> tuple[dict, object]:
    model = gpt["model"]
    plan = plan_for(model, make_config(layers="TransformerBlock"))
    path = save_plan(plan, tmp_path / "plan.json", model)
    return json.loads(path.read_text()), path


def test_a_plan_naming_modules_the_model_lacks_is_refused_with_the_closest_names(gpt: dict, tmp_path) -> None:
    data, path = _saved(gpt, tmp_path)
    data["groups"][0]["names"] = ["blocks.0", "blokcs.1"]
    data["modules"]["blokcs.1"] = data["modules"].pop("blocks.1")
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"^ckpt\.plan={path} names 1 module\(s\) that GPT does not have: "
                       r"blokcs\.1; module names, closest first: blokcs\.1: blocks\.1, ") as err:
        load_plan(path, gpt["model"])
    assert err.value.keys == ["ckpt.plan"]


def test_a_plan_for_modules_of_another_class_is_refused(gpt: dict, tmp_path) -> None:
    data, path = _saved(gpt, tmp_path)
    data["modules"]["blocks.1"] = "Bottleneck"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"^ckpt\.plan={path} was made for another model: 1 module\(s\) of "
                       r"another class in GPT: blocks\.1 is a TransformerBlock, the plan's a Bottleneck"):
        load_plan(path, gpt["model"])


def test_a_plan_of_another_format_is_refused(gpt: dict, tmp_path) -> None:
    data, path = _saved(gpt, tmp_path)
    data["format"] = FORMAT + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"^ckpt\.plan={path} is a plan file of format {FORMAT + 1}, written by "
                       rf"ckpt_plugin .*; this ckpt_plugin .* reads format {FORMAT}"):
        load_plan(path, gpt["model"])


def test_a_plan_file_that_does_not_exist_is_refused_when_the_config_is_built(tmp_path) -> None:
    missing = tmp_path / "nowhere.json"
    with pytest.raises(ConfigError, match=rf"^ckpt\.plan={missing}: no such file") as err:
        make_config(mode="auto", plan=str(missing))
    assert err.value.keys == ["ckpt.plan"]


def test_a_deepspeed_checkpoint_is_not_written_to_a_plan_file(gpt: dict, tmp_path) -> None:
    plan = WrapPlan((EachLayer(("blocks.0",), Treatment(checkpoint_fn=lambda *a, **k: None)),))
    with pytest.raises(ConfigError, match=r"^a plan with DeepSpeed's own checkpoint .* cannot be written"):
        save_plan(plan, tmp_path / "plan.json", gpt["model"])
    assert not (tmp_path / "plan.json").exists()


# ---------------------------------------------------------------------- through the callback: kept, given back, resumed


def _fit(tmp_path, ckpt_path=None, max_steps: int = 2, **keys):
    from test_callback_state import Net, fit

    from ckpt_plugin import ActivationCheckpointing

    callback = ActivationCheckpointing(mode="auto", **keys)
    trainer = fit(callback, Net(), tmp_path, max_steps=max_steps, ckpt_path=ckpt_path)
    return callback, trainer


def _no_planning(monkeypatch) -> None:
    """ckpt=auto's profile (our own entry point to all measuring and timing) fails if anything calls it."""
    import ckpt_plugin.apply.segments as segments
    import ckpt_plugin.apply.strategies as strategies

    def refuse(*args, **kwargs):
        raise AssertionError("the profile ran")

    monkeypatch.setattr(strategies, "profile", refuse)
    monkeypatch.setattr(strategies, "chain_costs", refuse)
    monkeypatch.setattr(segments, "chain_costs", refuse)


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict:
    """A ckpt=auto fit of two steps (budget 0.5 of 4 Blocks), its plan file and a checkpoint."""
    tmp = tmp_path_factory.mktemp("planned")
    callback, trainer = _fit(tmp, layers="Block", budget=0.5)
    trainer.save_checkpoint(tmp / "two_steps.ckpt")
    return {"callback": callback, "dir": tmp, "checkpoint": tmp / "two_steps.ckpt"}


def test_a_run_that_planned_writes_its_plan_in_the_log_dir_and_its_checkpoint(planned: dict) -> None:
    callback = planned["callback"]
    assert callback.plan_path == planned["dir"] / "ckpt_plan.json"  # logger=False: the default_root_dir
    saved = json.loads(callback.plan_path.read_text())
    assert [n for g in saved["groups"] for n in g["names"]] == callback.wrapped and callback.wrapped
    assert saved["planned"]["predicted_peak"] == callback.planned.predicted_peak
    checkpoint = torch.load(planned["checkpoint"], weights_only=True)
    assert checkpoint["callbacks"]["ActivationCheckpointing"]["plan"] == saved


def test_ckpt_plan_installs_the_file_without_planning(planned: dict, tmp_path, monkeypatch, caplog) -> None:
    _no_planning(monkeypatch)
    path = planned["callback"].plan_path
    with caplog.at_level("INFO"):
        callback, _ = _fit(tmp_path, plan=str(path))  # no layers, no budget: the file decides
    assert callback.wrapped == planned["callback"].wrapped
    assert f"ckpt.plan: installing the plan in {path} as it is, without planning" in caplog.text
    assert callback.plan_path is None  # nothing planned, nothing written


def test_a_resume_installs_the_checkpoints_plan_without_planning(planned: dict, tmp_path, monkeypatch,
                                                                caplog) -> None:
    _no_planning(monkeypatch)
    with caplog.at_level("INFO"):
        callback, trainer = _fit(tmp_path, ckpt_path=planned["checkpoint"], max_steps=3, layers="Block", budget=0.5)
    assert trainer.global_step == 3 and callback.wrapped == planned["callback"].wrapped
    assert "ckpt=auto: resuming with the checkpoint's plan, installed as it is, without planning" in caplog.text


def test_a_resume_with_other_keys_plans_anew(planned: dict, tmp_path) -> None:
    with pytest.warns(UserWarning, match=r"budget 0\.5 -> 0\.9\. Training resumes with this run's config"):
        callback, _ = _fit(tmp_path, ckpt_path=planned["checkpoint"], max_steps=3, layers="Block", budget=0.9)
    assert callback.plan_path == tmp_path / "ckpt_plan.json"  # planned, and written
