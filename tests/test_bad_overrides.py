"""Every mistake a user can type into a ``ckpt`` override: exit code 2 and the message alone, never a traceback.

The recipe's own path, in process: Hydra composes ``recipes/configs/train.yaml`` with the
overrides (as ``python recipes/train.py <overrides>`` does), and ``train(cfg)`` runs inside
``config_errors_exit()``, as the recipe's ``main`` runs it. A mistake must end there as
``SystemExit(2)`` with ``Error: <message>`` and the ``HYDRA_FULL_ERROR=1`` hint on the stream,
the message naming the key and the value as typed; any other exception (what would reach the
user as a traceback) fails the test. ``tests/test_errors.py`` runs a handful of the same
through ``recipes/train.py`` as a process of its own.

The overrides are not Hydra's own errors: an unknown preset (``ckpt=fulll``), a key the
preset lacks without ``+`` (``ckpt.foo=1``) and bad override syntax are refused by Hydra
while composing, before the app runs (its message alone, exit code 1).
"""

from __future__ import annotations

import io
from typing import NamedTuple

import pytest
from hydra import compose, initialize_config_dir

from ckpt_plugin.config.hydra import register_configs
from ckpt_plugin.lightning.app import config_errors_exit
from conftest import CONFIGS, FAST, TINY_GPT
from recipes.train import train

HINT = "(HYDRA_FULL_ERROR=1 shows the traceback.)"
BUDGET_FORMS = ("valid: a fraction of the activation peak without checkpointing (0.4, 40%), a size "
                "(2GiB, 512MiB, 300MB, '2 GiB', or an integer number of bytes), or min (the least peak reachable)")
DEEPSPEED_TRAINERS = "trainer=deepspeed_zero1, deepspeed_zero2, deepspeed_zero3 or deepspeed_zero3_offload"
BLOCK_NAMES = "blocks, blocks.0, blocks.1, blocks.2, blocks.3, "


class Case(NamedTuple):
    overrides: tuple[str, ...]  # after TINY_GPT and FAST: model/gpt.yaml sets ckpt.layers=TransformerBlock
    key: str  # named in the message
    shown: str  # the value as the message shows it
    message: str  # the whole message; one ending in "..." is its beginning


def case(overrides: str, key: str, shown: str, message: str) -> Case:
    return Case(tuple(overrides.split("  ")), key, shown, message)


CASES = [
    # ckpt.every_n
    case("ckpt.every_n=0", "ckpt.every_n", "0",
         "ckpt.every_n=0 must be >= 1: 1 wraps every matched layer, 2 every second one, ..."),
    case("ckpt.every_n=-2", "ckpt.every_n", "-2",
         "ckpt.every_n=-2 must be >= 1: 1 wraps every matched layer, 2 every second one, ..."),
    case("ckpt.every_n=two", "ckpt.every_n", "'two'", "ckpt.every_n='two' (str) must be an integer >= 1"),
    case("ckpt.every_n=1.5", "ckpt.every_n", "1.5", "ckpt.every_n=1.5 (float) must be an integer >= 1"),
    case("ckpt.every_n=true", "ckpt.every_n", "True", "ckpt.every_n=True (bool) must be an integer >= 1"),
    case("ckpt.every_n=[2]", "ckpt.every_n", "[2]", "ckpt.every_n=[2] (list) must be an integer >= 1"),
    case("ckpt.every_n='3'", "ckpt.every_n", "'3'", "ckpt.every_n='3' (str) must be an integer >= 1"),
    case("ckpt.every_n=5", "ckpt.every_n", "5",
         "ckpt.every_n=5 keeps none of the 4 matched layers (blocks.0, blocks.1, blocks.2, blocks.3); "
         "use a value from 1 to 4"),
    # booleans accept only booleans
    case("ckpt.preserve_rng_state=2", "ckpt.preserve_rng_state", "2",
         "ckpt.preserve_rng_state=2 (int) must be true or false"),
    case("ckpt.preserve_rng_state=yes", "ckpt.preserve_rng_state", "'yes'",
         "ckpt.preserve_rng_state='yes' (str) must be true or false"),
    case("ckpt.preserve_rng_state=0", "ckpt.preserve_rng_state", "0",
         "ckpt.preserve_rng_state=0 (int) must be true or false"),
    case("ckpt.preserve_rng_state=1", "ckpt.preserve_rng_state", "1",
         "ckpt.preserve_rng_state=1 (int) must be true or false"),
    case("ckpt.preserve_rng_state='true'", "ckpt.preserve_rng_state", "'true'",
         "ckpt.preserve_rng_state='true' (str) must be true or false"),
    case("ckpt.preserve_rng_state=[true]", "ckpt.preserve_rng_state", "[True]",
         "ckpt.preserve_rng_state=[True] (list) must be true or false"),
    case("ckpt.check_recompute=2", "ckpt.check_recompute", "2", "ckpt.check_recompute=2 (int) must be true or false"),
    case("ckpt.check_recompute=maybe", "ckpt.check_recompute", "'maybe'",
         "ckpt.check_recompute='maybe' (str) must be true or false"),
    case("ckpt.offload=1", "ckpt.offload", "1", "ckpt.offload=1 (int) must be true or false"),
    case("ckpt.offload=on", "ckpt.offload", "'on'", "ckpt.offload='on' (str) must be true or false"),
    case("ckpt.check_recompute=true  ckpt.segments=2", "ckpt.check_recompute", "true",
         "ckpt.check_recompute=true cannot be combined with ckpt.segments=2: it names the one module a checkpoint "
         "wraps, and a segment wraps several (torch's own check still runs); drop one of the two"),
    # ckpt.segments
    case("ckpt.segments=0", "ckpt.segments", "0",
         "ckpt.segments=0 must be >= 1: the number of checkpointed segments (or 'sqrt', 'recursive')"),
    case("ckpt.segments=-1", "ckpt.segments", "-1",
         "ckpt.segments=-1 must be >= 1: the number of checkpointed segments (or 'sqrt', 'recursive')"),
    case("ckpt.segments=cube", "ckpt.segments", "'cube'",
         "ckpt.segments='cube' (str) must be an integer >= 1, 'sqrt', 'recursive' or 'optimal' (or null for one checkpoint "
         "per layer)"),
    case("ckpt.segments=2.5", "ckpt.segments", "2.5",
         "ckpt.segments=2.5 (float) must be an integer >= 1, 'sqrt', 'recursive' or 'optimal' (or null for one checkpoint "
         "per layer)"),
    case("ckpt.segments=true", "ckpt.segments", "True",
         "ckpt.segments=True (bool) must be an integer >= 1, 'sqrt', 'recursive' or 'optimal' (or null for one checkpoint "
         "per layer)"),
    case("ckpt.segments=9", "ckpt.segments", "9",
         "ckpt.segments=9 asks for more segments than the 4 layers of the chain; use a value from 1 to 4, 'sqrt' "
         "or 'recursive'"),
    case("ckpt.segments=2  ckpt.every_n=2", "ckpt.segments", "2",
         "ckpt.segments=2 cannot be combined with ckpt.every_n=2: segments group consecutive layers; drop one of "
         "the two"),
    case("ckpt.segments=2  ckpt.layers=[blocks.0,blocks.2]", "ckpt.segments", "blocks.0, blocks.2",
         "ckpt.segments: blocks.0, blocks.2 are not consecutive children of blocks; select a run of consecutive "
         "blocks (ckpt.every_n cannot be combined with segments)"),
    # ckpt.layers
    case("ckpt.layers=TransformerBlok", "ckpt.layers", "'TransformerBlok'",
         "ckpt.layers: no module of class 'TransformerBlok' in GPT and none named 'TransformerBlok'; class names "
         "in this model, closest first: TransformerBlock, ..."),
    case("ckpt.layers=[TransformerBlok,Attn]", "ckpt.layers", "'Attn'",
         "2 problems in ckpt.layers:\n  - ckpt.layers: no module of class 'TransformerBlok' in GPT and none named "
         "'TransformerBlok'; class names in this model, closest first: TransformerBlock, ..."),
    case("ckpt.layers=haed", "ckpt.layers", "'haed'",
         "ckpt.layers: no module of class 'haed' in GPT and none named 'haed'; class names in this model, closest "
         "first: Embedding, LayerNorm, Linear, TransformerBlock, CausalSelfAttention, ModuleList, Dropout, GPT, "
         "MLP; module names, closest first: head, drop, ..."),
    case("ckpt.layers=[]", "ckpt.layers", "[]",
         "ckpt.layers=[] names no layers: give at least one class name or pattern, or choose ckpt=none to switch "
         "checkpointing off"),
    case("ckpt.layers=3", "ckpt.layers", "3",
         "ckpt.layers=3 (int) must be a string or a list of strings: class names, dotted class paths, module-name "
         "globs or 're:' regexes"),
    case("ckpt.layers={a:1}", "ckpt.layers", "{'a': 1}",
         "ckpt.layers={'a': 1} (dict) must be a string or a list of strings: class names, dotted class paths, "
         "module-name globs or 're:' regexes"),
    case("ckpt.layers=[TransformerBlock,3]", "ckpt.layers", "[3]", "ckpt.layers: every entry must be a string, got [3]"),
    case("ckpt.layers=' '", "ckpt.layers", "' '", "ckpt.layers: every entry must be a non-empty string, got ' '"),
    case("ckpt.layers=null", "ckpt.layers", "ckpt.layers is required",
         "ckpt.layers is required: name the modules to checkpoint, e.g. ckpt.layers=TransformerBlock or "
         "ckpt.layers=[Block,'blocks.*'], or let ckpt.layers=auto choose them (or choose ckpt=none to switch "
         "checkpointing off)"),
    case("ckpt.layers='re:blocks.(['", "ckpt.layers", "'re:blocks.(['",
         "ckpt.layers: 're:blocks.([' is not a valid regular expression (unterminated character set at position 8)"),
    case("ckpt.layers=blocks.*.atn", "ckpt.layers", "'blocks.*.atn'",
         "ckpt.layers: the glob 'blocks.*.atn' matches no module name in GPT; module names, closest first: "
         "blocks.0.attn, blocks.1.attn, blocks.2.attn, blocks.3.attn, ..."),
    case("ckpt.layers=no_such_pkg.Block", "ckpt.layers", "'no_such_pkg.Block'",
         "ckpt.layers: 'no_such_pkg.Block' is neither a module name in the model nor an importable class (write a "
         f"class as 'package.module.ClassName'); module names, closest first: {BLOCK_NAMES}..."),
    case("ckpt.layers=torch.nn.functional.relu", "ckpt.layers", "'torch.nn.functional.relu'",
         "ckpt.layers: 'torch.nn.functional.relu' is neither a module name in the model nor an importable class "
         "(write a class as 'package.module.ClassName'); module names, closest first: ..."),
    case("ckpt.layers=torch.nn.Conv2d", "ckpt.layers", "'torch.nn.Conv2d'",
         "ckpt.layers: no module in GPT is an instance of 'torch.nn.Conv2d'; class names in this model: "
         "CausalSelfAttention, Dropout, Embedding, GPT, LayerNorm, Linear, MLP, ModuleList, TransformerBlock"),
    case("ckpt.layers=blocks", "ckpt.layers", "'blocks'",
         "ckpt.layers: 'blocks' selects only blocks (ModuleList), which has no forward: nothing calls it, so "
         "checkpointing would do nothing; select the modules inside, e.g. 'blocks.*'"),
    case("ckpt.layers=[auto,TransformerBlock]", "ckpt.layers", "'TransformerBlock'",
         "ckpt.layers: 'auto' chooses every layer itself and cannot be combined with other entries "
         "('TransformerBlock'); give ckpt.layers=auto alone, or name every layer"),
    # interpolations that do not resolve
    case("ckpt.layers=${oc.env:NOPE}", "ckpt.layers", "'${oc.env:NOPE}'",
         "ckpt.layers='${oc.env:NOPE}' does not resolve: KeyError raised while resolving interpolation: "
         "\"Environment variable 'NOPE' not found\"; set what the interpolation refers to, or give the value itself"),
    case("ckpt.layers=${nope}", "ckpt.layers", "'${nope}'",
         "ckpt.layers='${nope}' does not resolve: Interpolation key 'nope' not found; set what the interpolation "
         "refers to, or give the value itself"),
    case("ckpt.every_n=${oc.decode:'[1'}", "ckpt.every_n", "\"${oc.decode:'[1'}\"",
         "ckpt.every_n=\"${oc.decode:'[1'}\" does not resolve: ..."),
    # keys, mode and target
    case("+ckpt.layer=TransformerBlock", "ckpt.layer", "ckpt.layer",
         "unknown key ckpt.layer (did you mean ckpt.layers?) for ckpt mode 'full'; valid keys: layers, every_n, "
         "sample, preserve_rng_state, check_recompute, segments, offload, budget, deepspeed, compile"),
    case("ckpt=full  ckpt.sample=first", "ckpt.sample", "'first'",
         "ckpt.sample='first' is not one of step, forward, none; step: the trainer's training_step on the first "
         "batch (the default); forward: the module's forward on example_input_array; none: measure nothing (fixed "
         "modes)"),
    case("ckpt=auto  ckpt.budget=0.5  ckpt.sample=none", "ckpt.sample", "ckpt.sample=none",
         "ckpt.sample=none measures nothing, and ckpt=auto plans by measuring the step; ckpt.sample=step (the "
         "default) or forward"),
    case("ckpt.budget=0.5", "ckpt.budget", "0.5",
         "ckpt.budget=0.5 is only read with ckpt.segments=optimal, not ckpt.segments=null; set ckpt.segments=optimal "
         "(the least recomputation that fits the budget), or drop ckpt.budget (ckpt=auto takes a budget too: it "
         "chooses per layer)"),
    case("ckpt.segments=optimal", "ckpt.budget", "ckpt.segments=optimal",
         "ckpt.segments=optimal needs ckpt.budget: a fraction of the activation peak without checkpointing (0.3) or a "
         "size (2GiB); or choose ckpt.segments=sqrt or recursive, which need no budget"),
    case("ckpt.segments=optimal  ckpt.budget=2", "ckpt.budget", "2",
         "ckpt.budget=2 would be 2 bytes (an integer is a number of bytes): did you mean a fraction or a size with a "
         "unit?; write e.g. 0.4, 40% or 2GiB, or 2B if 2 bytes are meant; ..."),
    case("ckpt=selective  ckpt.segments=optimal", "ckpt.segments", "optimal",
         "ckpt.segments=optimal is planned for ckpt=full's regions, which keep only their inputs: ..."),
    case("ckpt.mode=fulll", "ckpt.mode", "'fulll'",
         "ckpt.mode='fulll' is not a mode; valid modes, closest first: 'full', 'offload', 'auto', 'selective', 'none'"),
    case("ckpt.mode=null", "ckpt.mode", "None",
         "ckpt.mode=None is not a mode; valid modes, closest first: ..."),
    case("ckpt._target_=builtins.dict", "ckpt._target_", "'builtins.dict'",
         "ckpt._target_='builtins.dict': the ckpt node builds the plugin's callback, "
         "ckpt_plugin.ActivationCheckpointing, and its _target_ is not a setting; drop the override of "
         "ckpt._target_; choose a preset with ckpt=<name> (full, selective, offload, auto, deepspeed, none, ...) "
         "and set its keys with ckpt.<key>=<value>"),
    case("ckpt._target_=ckpt_plugin.ResumableRNG", "ckpt._target_", "'ckpt_plugin.ResumableRNG'",
         "ckpt._target_='ckpt_plugin.ResumableRNG': the ckpt node builds the plugin's callback, ..."),
    # ckpt=selective and ckpt=names
    case("ckpt=selective  ckpt.policy=everything", "ckpt.policy", "'everything'",
         "ckpt.policy='everything' is not a policy; valid policies, closest first: ..."),
    case("ckpt=selective  ckpt.policy=3", "ckpt.policy", "3",
         "ckpt.policy=3 (int) must be one of matmuls, matmuls_no_batch, names or a list of aten op names"),
    case("ckpt=selective  ckpt.policy=[aten.mm,aten.nope]", "ckpt.policy", "'aten.nope'",
         "ckpt.policy: unknown op 'aten.nope'; closest aten ops: ..."),
    case("ckpt=selective  ckpt.policy=names", "ckpt.policy", "names",
         "ckpt.policy=names needs ckpt.save_names (save only these names) or ckpt.exclude_names (save every name "
         "but these)"),
    case("ckpt=selective  ckpt.save_names=[x]", "ckpt.save_names", "'matmuls'",
         "ckpt.save_names needs ckpt.policy=names, got ckpt.policy='matmuls'"),
    case("ckpt=names  ckpt.exclude_names=[mlp_hidden]", "ckpt.exclude_names", "both set",
         "ckpt.save_names and ckpt.exclude_names are both set: give one, save_names to save only those names, "
         "exclude_names to save every name but those"),
    case("ckpt=names  ckpt.save_names=[atn_out]", "ckpt.save_names", "'atn_out'",
         "ckpt.save_names: no checkpoint_name in the model uses 'atn_out'; names used: attn_out, mlp_hidden"),
    case("ckpt=selective  ckpt.preserve_rng_state=no", "ckpt.preserve_rng_state", "'no'",
         "ckpt.preserve_rng_state='no' (str) must be true or false"),
    case("ckpt=selective  ckpt.offload=2", "ckpt.offload", "2", "ckpt.offload=2 (int) must be true or false"),
    # ckpt=auto and ckpt.budget
    case("ckpt=auto", "ckpt.budget", "ckpt=auto",
         "ckpt=auto needs ckpt.budget: a fraction of the activation peak without checkpointing (0.4) or a size "
         "(2GiB), or ckpt.memory: the device memory for the whole step (70GiB, device)"),
    case("ckpt=auto  ckpt.memory=2GiB  ckpt.budget=0.5", "ckpt.memory", "'2GiB'",
         "ckpt.memory='2GiB' cannot be combined with ckpt.budget=0.5: ckpt.budget is the activation memory alone (a "
         "share of the peak without checkpointing, or a size), ckpt.memory the device memory the whole step must fit "
         "on one rank (parameters, gradients, optimizer state, activations); drop one of the two"),
    case("ckpt=auto  ckpt.memory=70", "ckpt.memory", "70",
         "ckpt.memory=70 would be 70 bytes (an integer is a number of bytes): did you mean a size with a unit?; ..."),
    case("ckpt=auto  ckpt.memory=8GiB  ckpt.batch=4", "ckpt.batch", "4",
         "ckpt.batch=4 (int) must be null (the batch the dataloader has) or max (the largest micro-batch whose whole "
         "step fits ckpt.memory); a batch size of 4 is the dataloader's own setting (its batch_size)"),
    case("ckpt=auto  ckpt.budget=2", "ckpt.budget", "2",
         "ckpt.budget=2 would be 2 bytes (an integer is a number of bytes): did you mean a fraction or a size with "
         f"a unit?; write e.g. 0.4, 40% or 2GiB, or 2B if 2 bytes are meant; {BUDGET_FORMS}"),
    case("ckpt=auto  ckpt.budget=300", "ckpt.budget", "300",
         "ckpt.budget=300 would be 300 bytes (an integer is a number of bytes): did you mean a fraction or a size "
         f"with a unit?; write e.g. 0.4, 40% or 2GiB, or 300B if 300 bytes are meant; {BUDGET_FORMS}"),
    case("ckpt=auto  ckpt.budget=0", "ckpt.budget", "0", f"ckpt.budget=0 must be positive; {BUDGET_FORMS}"),
    case("ckpt=auto  ckpt.budget=1.5", "ckpt.budget", "1.5",
         f"ckpt.budget=1.5: a fraction must be in (0, 1]; for a size write e.g. 1.5GiB; {BUDGET_FORMS}"),
    case("ckpt=auto  ckpt.budget=lots", "ckpt.budget", "'lots'",
         "ckpt.budget='lots' is not a budget: write a fraction of the activation peak without checkpointing (0.4, "
         "40%), a size (2GiB, 512MiB, 300MB, '2 GiB', or an integer number of bytes), or min (the least peak "
         "reachable); a size's unit is B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024), in any "
         "case"),
    case("ckpt=auto  ckpt.budget=3 GiBs", "ckpt.budget", "'3 GiBs'",
         "ckpt.budget='3 GiBs' is not a budget: write a fraction of the activation peak without checkpointing ..."),
    case("ckpt=auto  ckpt.budget=150%", "ckpt.budget", "'150%'",
         f"ckpt.budget='150%': a fraction must be in (0, 1]; at most 100%; {BUDGET_FORMS}"),
    case("ckpt=auto  ckpt.budget=-1GiB", "ckpt.budget", "'-1GiB'", f"ckpt.budget='-1GiB' must be positive; {BUDGET_FORMS}"),
    case("ckpt=auto  ckpt.budget=true", "ckpt.budget", "True",
         f"ckpt.budget=True (bool) must be a fraction (0.4) or a size (2GiB); {BUDGET_FORMS}"),
    case("ckpt=auto  ckpt.budget=[1]", "ckpt.budget", "[1]",
         f"ckpt.budget=[1] (list) must be a fraction (0.4) or a size (2GiB); {BUDGET_FORMS}"),
    case("ckpt=auto  ckpt.budget=0.5  ckpt.preserve_rng_state=2", "ckpt.preserve_rng_state", "2",
         "ckpt.preserve_rng_state=2 (int) must be true or false"),
    case("ckpt=auto  ckpt.budget=0.5  +ckpt.segments=2", "ckpt.segments", "ckpt.segments",
         "unknown key ckpt.segments for ckpt mode 'auto'; valid keys: layers, every_n, sample, preserve_rng_state, offload, "
         "budget, memory, batch, compile, timing, plan"),
    case("ckpt=auto  ckpt.budget=0.5  ckpt.offload=maybe", "ckpt.offload", "'maybe'",
         "ckpt.offload='maybe' (str) must be true or false"),
    case("ckpt=auto  ckpt.budget=0.5  ckpt.timing=compiledd", "ckpt.timing", "'compiledd'",
         "ckpt.timing='compiledd' is neither 'auto', 'eager', 'compiled' nor a torch.compile backend; "
         "closest first: 'compiled', ..."),
    case("ckpt=auto  ckpt.budget=0.5  ckpt.timing=[eager]", "ckpt.timing", "['eager']",
         "ckpt.timing=['eager'] (list) must be one of 'auto', 'eager', 'compiled' or the name of a torch.compile "
         "backend"),
    case("ckpt=auto  ckpt.budget=0.5  ckpt.layers=TransformerBlok", "ckpt.layers", "'TransformerBlok'",
         "ckpt.layers: no module of class 'TransformerBlok' in GPT and none named 'TransformerBlok'; ..."),
    # ckpt=offload
    case("ckpt=offload  ckpt.every_n=0", "ckpt.every_n", "0",
         "ckpt.every_n=0 must be >= 1: 1 wraps every matched layer, 2 every second one, ..."),
    case("ckpt=offload  +ckpt.preserve_rng_state=false", "ckpt.preserve_rng_state", "ckpt.preserve_rng_state",
         "unknown key ckpt.preserve_rng_state for ckpt mode 'offload'; valid keys: layers, every_n, sample, compile"),
    # ckpt=deepspeed
    case("ckpt=deepspeed", "ckpt.deepspeed", "'auto'",
         "ckpt.deepspeed is set (ckpt=deepspeed: DeepSpeed's own checkpoint) but trainer.strategy is 'auto', not a "
         f"DeepSpeed strategy; choose {DEEPSPEED_TRAINERS}; or choose another ckpt preset (torch's checkpoint works "
         "under every strategy)"),
    case("ckpt.deepspeed={}  trainer=ddp", "ckpt.deepspeed", "DDPStrategy",
         "ckpt.deepspeed is set (ckpt=deepspeed: DeepSpeed's own checkpoint) but trainer.strategy is DDPStrategy, "
         f"not a DeepSpeed strategy; choose {DEEPSPEED_TRAINERS}; or choose another ckpt preset (torch's checkpoint "
         "works under every strategy)"),
    case("ckpt=deepspeed  trainer=deepspeed_zero1  ckpt.deepspeed.partition_activations=2",
         "ckpt.deepspeed.partition_activations", "2",
         "ckpt.deepspeed.partition_activations=2 (int) must be true or false"),
    case("ckpt=deepspeed  trainer=deepspeed_zero3  ckpt.deepspeed.contiguous_memory_optimization=true  "
         "ckpt.deepspeed.partition_activations=true", "ckpt.deepspeed.contiguous_memory_optimization", "true",
         "ckpt.deepspeed.contiguous_memory_optimization=true needs ckpt.deepspeed.number_checkpoints (the number of "
         "checkpointed layers, e.g. the model's n_layer): DeepSpeed sizes the contiguous buffer from it"),
    case("ckpt=deepspeed  trainer=deepspeed_zero1  ckpt.deepspeed=5", "ckpt.deepspeed", "5",
         "ckpt.deepspeed=5 must be null or a mapping of DeepSpeed's checkpointing options (partition_activations, "
         "cpu_checkpointing, contiguous_memory_optimization, number_checkpoints, synchronize_checkpoint_boundary, "
         "profile); e.g. ckpt=deepspeed"),
    case("ckpt=deepspeed  trainer=deepspeed_zero1  +ckpt.deepspeed.foo=1", "ckpt.deepspeed.foo", "ckpt.deepspeed.foo",
         "unknown key ckpt.deepspeed.foo; valid keys: partition_activations, cpu_checkpointing, "
         "contiguous_memory_optimization, number_checkpoints, synchronize_checkpoint_boundary, profile"),
    case("ckpt=deepspeed  trainer=deepspeed_zero1  ckpt.segments=2", "ckpt.segments", "2",
         "ckpt.segments=2 cannot be combined with ckpt.deepspeed (DeepSpeed's own checkpoint): it checkpoints layer "
         "by layer; drop ckpt.segments"),
    case("ckpt=deepspeed  trainer=deepspeed_zero1  ckpt.deepspeed.number_checkpoints=0",
         "ckpt.deepspeed.number_checkpoints", "0",
         "ckpt.deepspeed.number_checkpoints=0 must be null or an integer >= 1 (the number of checkpointed layers in "
         "one forward)"),
    case("ckpt=deepspeed  trainer=deepspeed_zero1  ckpt.preserve_rng_state=false", "ckpt.preserve_rng_state", "false",
         "ckpt.preserve_rng_state=false cannot be combined with ckpt.deepspeed (DeepSpeed's own checkpoint): "
         "DeepSpeed's checkpoint always replays the RNG state"),
]


def recipe_outcome(*overrides: str) -> tuple[int, str]:
    """(exit code, stderr) of the recipe's path on ``overrides``: Hydra's compose, then ``train(cfg)`` in
    ``config_errors_exit()``; an exception other than SystemExit propagates (a user would see a traceback)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):  # Hydra stays set up, as in a run
        cfg = compose(config_name="train", overrides=[*TINY_GPT, *FAST, *overrides])
        stream = io.StringIO()
        try:
            with config_errors_exit(stream=stream):
                train(cfg)
        except SystemExit as done:
            return done.code, stream.getvalue()
        return 0, stream.getvalue()


def test_the_cases_are_60_distinct_overrides() -> None:
    assert len({c.overrides for c in CASES}) == len(CASES) >= 60


@pytest.mark.parametrize("bad", CASES, ids=["  ".join(c.overrides) for c in CASES])
def test_a_bad_override_exits_2_with_the_message_alone(bad: Case, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a Trainer would write lands here
    code, stderr = recipe_outcome(*bad.overrides)
    assert code == 2, stderr
    assert stderr.startswith("Error: ") and stderr.endswith(f"\n{HINT}\n"), stderr
    message = stderr.removeprefix("Error: ").removesuffix(f"\n{HINT}\n")
    if bad.message.endswith("..."):
        assert message.startswith(bad.message.removesuffix("...")), message
    else:
        assert message == bad.message
    assert bad.key in message and bad.shown in message, (bad.key, bad.shown, message)
