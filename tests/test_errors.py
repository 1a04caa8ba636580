"""Bad input gets a clear error and loses nothing: name the key, the value, the valid choices.

Three levels:

* the Python API (``apply_checkpointing`` / ``make_config``) and the Lightning
  callback (``ActivationCheckpointing`` validates its keys at construction);
* "nothing is wrapped half-way": a failing apply leaves the model exactly as
  it was, wrapped or not;
* the Hydra command line, by running ``recipes/train.py`` as a subprocess.

Every test matches the real message text, so a message that stops naming the
key, the value or the choices fails here.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import warm_python
from torch import nn

from ckpt_plugin import ActivationCheckpointing, apply_checkpointing, make_config, wrapped_modules
from ckpt_plugin.engine.wrap import CheckpointedForward
from ckpt_plugin.config.budget import parse_budget
from conftest import FAST, GROUP_DIRS, RECIPE, TINY_GPT, run_recipe, small_gpt

GPT_CLASSES = {
    "CausalSelfAttention", "Dropout", "Embedding", "GPT", "LayerNorm",
    "Linear", "MLP", "ModuleList", "TransformerBlock",
}  # fmt: skip
BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
ATTNS = {"blocks.0.attn", "blocks.1.attn", "blocks.2.attn", "blocks.3.attn"}


def listed_after(marker: str, message: str) -> list[str]:
    """The comma-separated names an error lists after ``marker`` (up to the end of that line)."""
    line = next(ln for ln in message.splitlines() if marker in ln)
    tail = line.split(marker, 1)[1]
    tail = re.sub(r", \.\.\. \(\d+ more\)$", "", tail)
    return [name.strip() for name in tail.split(",")]


def raises_for(match: str, **keys) -> pytest.ExceptionInfo[ValueError]:
    """``apply_checkpointing(small_gpt(), **keys)`` must raise a ValueError matching ``match``."""
    with pytest.raises(ValueError, match=match) as info:
        apply_checkpointing(small_gpt(), **keys)
    return info


def assert_untouched(model: nn.Module) -> None:
    assert wrapped_modules(model) == []
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__, f"{name or '<root>'} has an instance-level forward"


# --------------------------------------------------------------------------- #
# ckpt.layers checked against the model
# --------------------------------------------------------------------------- #


def test_unknown_class_name_lists_class_names_closest_first():
    info = raises_for(
        r"^ckpt\.layers: no module of class 'TransformerBlok' in GPT and none named 'TransformerBlok'; "
        r"class names in this model, closest first: TransformerBlock, ",
        layers="TransformerBlok",
    )
    classes, modules = str(info.value).split("; module names, closest first: ")
    names = listed_after("closest first: ", classes)
    assert names[0] == "TransformerBlock"  # the closest one is first, explicitly
    assert set(names) == GPT_CLASSES  # and every class of the model is offered
    assert modules.split(", ")[:5] == ["blocks", *BLOCKS]  # a plain word may name a module: those are offered too


def test_glob_matching_nothing_lists_module_names_closest_first():
    info = raises_for(
        r"^ckpt\.layers: the glob 'blocks\.\*\.atn' matches no module name in GPT; "
        r"module names, closest first: blocks\.\d\.attn, ",
        layers="blocks.*.atn",
    )
    message = str(info.value)
    names = listed_after("closest first: ", message)
    assert set(names[:4]) == ATTNS  # the four near misses lead the list
    assert len(names) == 12 and message.endswith("... (38 more)")  # long lists are cut, with a count


def test_regex_matching_nothing_lists_module_names_closest_first():
    text = r"re:blocks\.[0-9]+\.atn"
    info = raises_for(
        "^" + re.escape(f"ckpt.layers: the regex {text!r} matches no module name in GPT; module names, closest first: "),
        layers=text,
    )
    assert set(listed_after("closest first: ", str(info.value))[:4]) == ATTNS


def test_invalid_regex_names_entry_and_reason():
    raises_for(
        re.escape("ckpt.layers: 're:blocks.([' is not a valid regular expression (unterminated character set"),
        layers="re:blocks.([",
    )


def test_dotted_path_not_importable_lists_module_names_closest_first():
    info = raises_for(
        re.escape(
            "ckpt.layers: 'no_such_pkg.Block' is neither a module name in the model nor an importable "
            "class (write a class as 'package.module.ClassName'); module names, closest first: blocks, "
        ),
        layers="no_such_pkg.Block",
    )
    assert "... (38 more)" in str(info.value)


def test_misspelt_module_name_lists_the_real_one_first():
    raises_for(
        r"^ckpt\.layers: 'blocks\.0\.atn' is neither a module name in the model nor an importable class "
        r"\(write a class as 'package\.module\.ClassName'\); module names, closest first: blocks\.0\.attn, ",
        layers="blocks.0.atn",
    )


def test_dotted_path_to_missing_attribute():
    raises_for(r"^ckpt\.layers: 'torch\.nn\.Nope' is neither a module name in the model nor an importable class ", layers="torch.nn.Nope")


def test_dotted_path_to_a_function_not_a_class():
    raises_for(
        r"^ckpt\.layers: 'torch\.nn\.functional\.relu' is neither a module name in the model nor an importable class ",
        layers="torch.nn.functional.relu",
    )


def test_class_path_with_no_instance_lists_class_names():
    info = raises_for(
        r"^ckpt\.layers: no module in GPT is an instance of 'torch\.nn\.Conv2d'; class names in this model: ",
        layers="torch.nn.Conv2d",
    )
    assert set(listed_after("class names in this model: ", str(info.value))) == GPT_CLASSES


def test_two_bad_layer_names_reported_together():
    info = raises_for(r"^2 problems in ckpt\.layers:\n", layers=["TransformerBlok", "Attn"])
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("  - ckpt.layers: no module of class 'TransformerBlok' in GPT and none named 'TransformerBlok'; ")
    assert lines[2].startswith("  - ckpt.layers: no module of class 'Attn' in GPT and none named 'Attn'; ")
    assert "closest first: TransformerBlock," in lines[1]
    assert "closest first: CausalSelfAttention," in lines[2]


def test_bad_regex_and_bad_glob_reported_together():
    info = raises_for(r"^2 problems in ckpt\.layers:\n", layers=["re:(", "blocks.*.atn", "TransformerBlock"])
    message = str(info.value)
    assert "  - ckpt.layers: 're:(' is not a valid regular expression" in message
    assert "  - ckpt.layers: the glob 'blocks.*.atn' matches no module name in GPT" in message


def test_every_n_larger_than_matches_keeps_nothing():
    raises_for(
        re.escape(
            "ckpt.every_n=5 keeps none of the 4 matched layers (blocks.0, blocks.1, blocks.2, blocks.3); "
            "use a value from 1 to 4"
        ),
        layers="TransformerBlock",
        every_n=5,
    )


# --------------------------------------------------------------------------- #
# the keys themselves (checked before the model is looked at)
# --------------------------------------------------------------------------- #


def test_every_n_zero():
    raises_for(
        re.escape("ckpt.every_n=0 must be >= 1: 1 wraps every matched layer, 2 every second one, ..."),
        layers="TransformerBlock",
        every_n=0,
    )


def test_every_n_negative():
    raises_for(r"^ckpt\.every_n=-3 must be >= 1: ", layers="TransformerBlock", every_n=-3)


@pytest.mark.parametrize(
    ("value", "shown"),
    [("2", "'2' (str)"), (1.5, "1.5 (float)"), (True, "True (bool)")],
    ids=["every_n-str", "every_n-float", "every_n-bool"],
)
def test_every_n_wrong_type(value, shown):
    raises_for(re.escape(f"ckpt.every_n={shown} must be an integer >= 1"), layers="TransformerBlock", every_n=value)


def test_layers_missing():
    raises_for(
        re.escape(
            "ckpt.layers is required: name the modules to checkpoint, e.g. ckpt.layers=TransformerBlock "
            "or ckpt.layers=[Block,'blocks.*'], or let ckpt.layers=auto choose them "
            "(or choose ckpt=none to switch checkpointing off)"
        )
    )


def test_layers_empty_list():
    raises_for(
        re.escape("ckpt.layers=[] names no layers: give at least one class name or pattern, or choose ckpt=none"),
        layers=[],
    )


def test_layers_wrong_type():
    raises_for(
        re.escape(
            "ckpt.layers=3 (int) must be a string or a list of strings: class names, dotted class paths, "
            "module-name globs or 're:' regexes"
        ),
        layers=3,
    )


def test_layers_list_with_non_string():
    raises_for(r"^ckpt\.layers: every entry must be a string, got \[3\]$", layers=["TransformerBlock", 3])


def test_layers_list_with_blank_string():
    raises_for(r"^ckpt\.layers: every entry must be a non-empty string, got ' '$", layers=["TransformerBlock", " "])


def test_unknown_key_suggests_the_right_one():
    raises_for(
        re.escape(
            "unknown key ckpt.layer (did you mean ckpt.layers?) for ckpt mode 'full'; "
            "valid keys: layers, every_n, sample, preserve_rng_state"
        ),
        layer="TransformerBlock",
    )


def test_two_unknown_keys_reported_together_with_a_bad_value():
    info = raises_for(r"^4 problems in the ckpt config:\n", layer="TransformerBlock", evry_n=2, preserve_rng_state="no")
    assert str(info.value).splitlines()[1:] == [
        "  - unknown key ckpt.layer (did you mean ckpt.layers?) for ckpt mode 'full'; "
        "valid keys: layers, every_n, sample, preserve_rng_state, check_recompute, segments, offload, budget, deepspeed, compile",
        "  - unknown key ckpt.evry_n (did you mean ckpt.every_n?) for ckpt mode 'full'; "
        "valid keys: layers, every_n, sample, preserve_rng_state, check_recompute, segments, offload, budget, deepspeed, compile",
        "  - ckpt.layers is required: name the modules to checkpoint, e.g. ckpt.layers=TransformerBlock or "
        "ckpt.layers=[Block,'blocks.*'], or let ckpt.layers=auto choose them "
        "(or choose ckpt=none to switch checkpointing off)",
        "  - ckpt.preserve_rng_state='no' (str) must be true or false",
    ]


def test_unknown_mode_lists_full_first():
    info = raises_for(
        re.escape("ckpt.mode='fulll' is not a mode; valid modes, closest first: 'full', 'offload', 'auto', 'selective', 'none'"),
        mode="fulll",
        layers="TransformerBlock",
    )
    assert listed_after("closest first: ", str(info.value))[0] == "'full'"


def test_preserve_rng_state_not_a_bool():
    raises_for(
        re.escape("ckpt.preserve_rng_state='yes' (str) must be true or false"),
        layers="TransformerBlock",
        preserve_rng_state="yes",
    )


def test_several_key_problems_reported_together():
    with pytest.raises(ValueError, match=r"^3 problems in the ckpt config:\n") as info:
        make_config(layers=3, every_n=0, preserve_rng_state="yes")
    lines = str(info.value).splitlines()[1:]
    assert [ln.split("=", 1)[0] for ln in lines] == [
        "  - ckpt.layers",
        "  - ckpt.every_n",
        "  - ckpt.preserve_rng_state",
    ]


# --------------------------------------------------------------------------- #
# the Lightning callback
# --------------------------------------------------------------------------- #


def test_callback_rejects_unknown_key_at_construction():
    with pytest.raises(ValueError, match=re.escape("unknown key ckpt.layer (did you mean ckpt.layers?)")):
        ActivationCheckpointing(layer="TransformerBlock")


def test_callback_rejects_bad_every_n_at_construction():
    with pytest.raises(ValueError, match=re.escape("ckpt.every_n=0 must be >= 1")):
        ActivationCheckpointing(layers="TransformerBlock", every_n=0)


def test_callback_rejects_unknown_mode_at_construction():
    with pytest.raises(ValueError, match=re.escape("ckpt.mode='fulll' is not a mode; valid modes, closest first: 'full'")):
        ActivationCheckpointing(mode="fulll", layers="TransformerBlock")


def test_callback_unknown_layer_at_fit_start_wraps_nothing():
    # Layer names can only be checked against the model, in on_fit_start.
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    callback = ActivationCheckpointing(layers=["TransformerBlock", "TransformerBlok"])
    model = small_gpt()
    data = torch.randint(96, (4, 17))
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with pytest.raises(ValueError, match=r"no module of class 'TransformerBlok' in GPT and none named 'TransformerBlok'; class names in this model, closest first: TransformerBlock,"):
        trainer.fit(model, DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2))
    assert_untouched(model)
    assert callback.wrapped == []


# --------------------------------------------------------------------------- #
# nothing is wrapped half-way
# --------------------------------------------------------------------------- #


def test_failed_apply_on_plain_model_wraps_nothing():
    model = small_gpt()
    with pytest.raises(ValueError, match=r"no module of class 'Nope' in GPT"):
        apply_checkpointing(model, layers=["TransformerBlock", "Nope"])
    assert_untouched(model)


def test_failed_every_n_on_plain_model_wraps_nothing():
    model = small_gpt()
    with pytest.raises(ValueError, match=r"ckpt\.every_n=5 keeps none of the 4 matched layers"):
        apply_checkpointing(model, layers="TransformerBlock", every_n=5)
    assert_untouched(model)


@pytest.mark.parametrize(
    "bad",
    [
        dict(layers=["blocks.*.attn", "Nope"]),  # fails against the model
        dict(layers="blocks.*.attn", every_n=9),  # fails after matching
        dict(layers="blocks.*.attn", every_n=0),  # fails before the model is looked at
        dict(layers="re:("),  # fails while parsing
    ],
    ids=["unknown-layer", "every_n-too-large", "every_n-zero", "invalid-regex"],
)
def test_failed_second_apply_keeps_first_wrapping(bad):
    model = small_gpt()
    assert apply_checkpointing(model, layers="TransformerBlock") == BLOCKS
    before = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    assert list(before) == BLOCKS and all(isinstance(w, CheckpointedForward) for w in before.values())

    with pytest.raises(ValueError):
        apply_checkpointing(model, **bad)

    assert wrapped_modules(model) == BLOCKS
    after = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    assert after.keys() == before.keys()
    assert all(after[n] is before[n] for n in BLOCKS)  # the very same wrappers, not re-made


# --------------------------------------------------------------------------- #
# the Hydra command line (recipes/train.py in a subprocess)
# --------------------------------------------------------------------------- #

CLI_CASES = {
    "unknown-preset": ("ckpt=fulll",),
    "unknown-key": ("ckpt.foo=1",),
    "wrong-type": ("ckpt.every_n=two",),
    "unknown-layer": ("ckpt.layers=TransformerBlok",),
    "too-many-segments": ("ckpt.segments=9",),
    "deepspeed-without-deepspeed": ("ckpt=deepspeed", "ckpt.layers=TransformerBlock"),
    "bad-budget": ("ckpt=auto", "ckpt.layers=TransformerBlock", "ckpt.budget=3 GiBs"),
    # issue #20, point 4: each of these met a traceback (or trained) before
    "unreachable-budget": ("ckpt=auto", "ckpt.budget=1KB"),
    "unresolved-interpolation": ("ckpt.layers=${oc.env:NOPE}",),
    "target-override": ("ckpt._target_=builtins.dict",),
    "int-as-bool": ("ckpt.preserve_rng_state=2",),
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Run the bad command lines at once (each takes seconds, mostly imports)."""

    # Directories made here, in one thread: tmp_path_factory is not thread-safe.
    dirs = {case: tmp_path_factory.mktemp(case) for case in CLI_CASES}

    def one(case):
        return case, run_recipe(*TINY_GPT, *FAST, *CLI_CASES[case], tmp_path=dirs[case], check=False)

    with ThreadPoolExecutor(len(CLI_CASES)) as pool:
        return dict(pool.map(one, CLI_CASES))


# Hydra words these two errors itself, while composing, before the app runs (its message alone, exit code 1);
# what must reach the user (in any Hydra release): a failed exit, the override as typed, and for a preset
# the valid ones (our files in the ckpt group).


def test_cli_unknown_preset(cli):
    proc = cli["unknown-preset"]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "ckpt/fulll" in proc.stderr
    listed = set(re.findall(r"\w+", proc.stderr.split("ckpt/fulll", 1)[1]))
    presets = {path.stem for path in GROUP_DIRS["ckpt"].glob("*.yaml")}
    assert presets and presets <= listed, (presets - listed, proc.stderr)


def test_cli_unknown_key(cli):
    proc = cli["unknown-key"]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "ckpt.foo" in proc.stderr and "+ckpt.foo=1" in proc.stderr  # with +, the plugin names the valid keys


def _short_error(proc) -> str:
    """The recipe's answer to a ckpt mistake: exit code 2, the message alone (no traceback); the message."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    first, hint = proc.stderr.rstrip("\n").splitlines()[-2:]
    assert hint == "(HYDRA_FULL_ERROR=1 shows the traceback.)"
    assert first.startswith("Error: ")
    return first.removeprefix("Error: ")


def test_cli_wrong_type(cli):
    # The ckpt node's values reach the plugin's checks as typed: its message, not OmegaConf's conversion
    assert _short_error(cli["wrong-type"]) == "ckpt.every_n='two' (str) must be an integer >= 1"


def test_cli_unreachable_budget(cli):
    # found once ckpt=auto has measured the model, in the callback's on_fit_start: still the message alone
    message = _short_error(cli["unreachable-budget"])
    assert re.fullmatch(
        r"ckpt\.budget: 1000 bytes \(1000 B, 0\.00 of the activation peak without checkpointing, [\d.]+ MiB\) cannot "
        r"be met by checkpointing ckpt\.layers: the least peak reachable is \d+ bytes \([\d.]+ KiB, 0\.\d+\); "
        r"raise ckpt\.budget to at least 0\.\d+ or \d+B, or select more layers\. Nor can any other plan: no "
        r"checkpointing of this model goes below [\d.]+ KiB \(\d+ B, 0\.\d+\): its forward alone holds that much "
        r"while [\w.]+ runs aten\.\w+, the modules it is called from holding their inputs and the op its inputs "
        r"and output", message), message
    assert "train_loss" not in cli["unreachable-budget"].stdout
    # the size it suggests can be typed back as it is written (a bare integer under 1 MiB is refused)
    suggested = re.search(r"or (\d+B), or select", message)[1]
    assert parse_budget(suggested, typed=True) == parse_budget(int(suggested[:-1]))


def test_cli_config_mistakes_that_met_a_traceback(cli):
    assert _short_error(cli["unresolved-interpolation"]) == (
        "ckpt.layers='${oc.env:NOPE}' does not resolve: KeyError raised while resolving interpolation: "
        "\"Environment variable 'NOPE' not found\"; set what the interpolation refers to, or give the value itself"
    )
    assert _short_error(cli["target-override"]) == (
        "ckpt._target_='builtins.dict': the ckpt node builds the plugin's callback, ckpt_plugin.ActivationCheckpointing, "
        "and its _target_ is not a setting; drop the override of ckpt._target_; choose a preset with ckpt=<name> "
        "(full, selective, offload, auto, deepspeed, none, ...) and set its keys with ckpt.<key>=<value>"
    )
    assert _short_error(cli["int-as-bool"]) == "ckpt.preserve_rng_state=2 (int) must be true or false"  # trained as true before
    for case in ("unresolved-interpolation", "target-override", "int-as-bool"):
        assert "Instantiating" not in cli[case].stdout + cli[case].stderr


def test_cli_unknown_layer(cli):
    proc = cli["unknown-layer"]
    assert _short_error(proc).startswith(
        "ckpt.layers: no module of class 'TransformerBlok' in GPT and none named 'TransformerBlok'; "
        "class names in this model, closest first: TransformerBlock, "
    )
    # found in the callback's setup: after the model is built, before configure_optimizers and training
    out = proc.stdout + proc.stderr  # Lightning's rank-zero log lines go to stderr
    assert "Instantiating model" in out
    assert "Trainer.fit` stopped" not in out and "train_loss" not in out


def test_cli_too_many_segments(cli):
    assert _short_error(cli["too-many-segments"]) == (
        "ckpt.segments=9 asks for more segments than the 4 layers of the chain; "
        "use a value from 1 to 4, 'sqrt' or 'recursive'"
    )
    assert "train_loss" not in cli["too-many-segments"].stdout


def test_cli_errors_found_before_anything_is_built(cli):
    """What the composed config shows wrong is reported before the data or the model is built."""
    assert _short_error(cli["deepspeed-without-deepspeed"]) == (
        "ckpt.deepspeed is set (ckpt=deepspeed: DeepSpeed's own checkpoint) but trainer.strategy is 'auto', "
        "not a DeepSpeed strategy; choose trainer=deepspeed_zero1, deepspeed_zero2, deepspeed_zero3 or "
        "deepspeed_zero3_offload; or choose another ckpt preset (torch's checkpoint works under every strategy)"
    )
    assert _short_error(cli["bad-budget"]).startswith("ckpt.budget='3 GiBs' is not a budget")
    for case in ("deepspeed-without-deepspeed", "bad-budget"):
        assert "Instantiating" not in cli[case].stdout + cli[case].stderr


def test_cli_full_error_with_hydra_full_error(tmp_path):
    proc = warm_python.run(
        [str(RECIPE), f"hydra.run.dir={tmp_path}", *TINY_GPT, "ckpt.every_n=0"],
        env=os.environ | {"HYDRA_FULL_ERROR": "1"}, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert proc.stderr.rstrip().endswith(
        "ckpt_plugin.errors.ConfigError: ckpt.every_n=0 must be >= 1: 1 wraps every matched layer, 2 every second one, ..."
    )


# --------------------------------------------------------------------------- #
# a plain word: a module's name first, else a class name
# --------------------------------------------------------------------------- #


def test_a_plain_word_selects_the_module_of_that_name():
    model = small_gpt()
    assert apply_checkpointing(model, layers="head") == ["head"]
    assert apply_checkpointing(model, layers=["ln_f", "head", "TransformerBlock"]) == [*BLOCKS, "ln_f", "head"]


def test_a_module_name_wins_over_a_class_name():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.Block = Block()  # named like the class of the two below
            self.stack = nn.Sequential(Block(), Block())

    assert apply_checkpointing(Net(), layers="Block") == ["Block"]  # not the three modules of class Block
    assert apply_checkpointing(Net(), layers="stack.*") == ["stack.0", "stack.1"]  # the others, by their names


def test_a_plain_word_matching_neither_lists_class_and_module_names_closest_first():
    raises_for(
        "^" + re.escape(
            "ckpt.layers: no module of class 'haed' in GPT and none named 'haed'; class names in this model, "
            "closest first: Embedding, LayerNorm, Linear, TransformerBlock, CausalSelfAttention, ModuleList, "
            "Dropout, GPT, MLP; module names, closest first: head, drop, "
        ),
        layers="haed",
    )


def test_a_container_without_forward_is_never_a_layer():
    # "blocks" is the ModuleList: nothing calls it, so wrapping it would checkpoint nothing.
    model = small_gpt()
    for layers in ("blocks", "ModuleList", "torch.nn.ModuleList"):
        with pytest.raises(ValueError, match="^" + re.escape(
                f"ckpt.layers: {layers!r} selects only blocks (ModuleList), which has no forward: nothing calls it, "
                "so checkpointing would do nothing; select the modules inside, e.g. 'blocks.*'") + "$"):
            apply_checkpointing(model, layers=layers)
        assert_untouched(model)
    # A pattern that also matches what is inside selects that instead.
    assert apply_checkpointing(model, layers="blocks*") == BLOCKS


# --------------------------------------------------------------------------- #
# ckpt.budget: every size parses or is an error, never a silent default
# --------------------------------------------------------------------------- #

BUDGET_FORMS = (
    "valid: a fraction of the activation peak without checkpointing (0.4, 40%), a size "
    "(2GiB, 512MiB, 300MB, '2 GiB', or an integer number of bytes), or min (the least peak reachable)"
)


@pytest.mark.parametrize(("given", "expected"), [
    ("3 GiB", "3.0 GiB"), ("3GiB", "3.0 GiB"), ("3 gib", "3.0 GiB"), (" 3 GiB ", "3.0 GiB"),
    ("512MB", "488.3 MiB"), ("0.4", "0.4 of the activation peak"), (0.4, "0.4 of the activation peak"),
    ("40%", "0.4 of the activation peak"), ("min", "the least activation peak reachable"),
])
def test_budget_sizes_with_or_without_a_space(given, expected):
    from ckpt_plugin.config.budget import parse_budget

    assert str(parse_budget(given)) == expected
    assert make_config(mode="auto", layers="TransformerBlock", budget=given).budget == given


@pytest.mark.parametrize(("given", "message"), [
    ("3 GiBs", "ckpt.budget='3 GiBs' is not a budget: write a fraction of the activation peak without checkpointing "
               "(0.4, 40%), a size (2GiB, 512MiB, 300MB, '2 GiB', or an integer number of bytes), or min (the least "
               "peak reachable); a size's unit is B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024), "
               "in any case"),
    ("lots", "ckpt.budget='lots' is not a budget: write a fraction of the activation peak without checkpointing "
             "(0.4, 40%), a size (2GiB, 512MiB, 300MB, '2 GiB', or an integer number of bytes), or min (the least "
             "peak reachable); a size's unit is B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024), "
             "in any case"),
    ("-1GiB", f"ckpt.budget='-1GiB' must be positive; {BUDGET_FORMS}"),
    ("0", f"ckpt.budget='0' must be positive; {BUDGET_FORMS}"),
    (0, f"ckpt.budget=0 must be positive; {BUDGET_FORMS}"),
    ("1.5", f"ckpt.budget='1.5': a fraction must be in (0, 1]; for a size write e.g. 1.5GiB; {BUDGET_FORMS}"),
    ("150%", f"ckpt.budget='150%': a fraction must be in (0, 1]; at most 100%; {BUDGET_FORMS}"),
    ("0.1 B", f"ckpt.budget='0.1 B' must be positive; {BUDGET_FORMS}"),
])
def test_budget_that_does_not_parse_is_an_error(given, message):
    from ckpt_plugin.config.budget import parse_budget

    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        parse_budget(given)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        make_config(mode="auto", layers="TransformerBlock", budget=given)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        apply_checkpointing(small_gpt(), mode="auto", layers="TransformerBlock", budget=given)
