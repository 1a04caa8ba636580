"""What each key of the ``ckpt`` node means, written once.

The callback's docstring (what ``--help`` of LightningCLI and Python's ``help()``
print), and the key reference of the docs (:mod:`ckpt_plugin.config.reference`)
are built from :data:`HELP`; which modes take a key and its default there come
from the mode dataclasses of ``schema.py``. A test checks that every key of every
mode has its text here and the callback's signature has exactly these keys.
"""

from __future__ import annotations

HELP: dict[str, str] = {
    "mode": (
        "full (torch's checkpoint around each layer: keep its inputs, recompute the rest), selective (save the "
        "outputs of the ops that policy names, recompute the others), offload (no recompute: what the layers save "
        "lives in CPU memory), auto (per layer keep, selective with either matmul policy, or full: the fastest "
        "step that fits budget or memory) or none (train without checkpointing; every other key is accepted and "
        "ignored)."
    ),
    "layers": (
        "The modules to checkpoint, required unless mode is none: auto (the model's repeated block), class names "
        "(Block), module names (blocks.3), dotted class paths (pkg.models.Block), module-name globs (blocks.*) or "
        "regexes (re:blocks\\.[0-9]+); one or a list. A plain word that names a module wins over a class name."
    ),
    "every_n": "Wrap every n-th matched layer (unset: 1, every one).",
    "sample": (
        "What the plugin measures (ckpt=auto's plan, the report, its checks): step (unset), the step the trainer "
        "runs, training_step on the first training batch, its loss included, every effect a user could see put "
        "back; forward, the module's forward on example_input_array; none, nothing (fixed modes)."
    ),
    "preserve_rng_state": (
        "Replay the RNG state on recompute, so dropout masks match (unset: true). Not for offload."
    ),
    "check_recompute": (
        "Name the module whose recomputation saves other tensors than its forward did, at a hook per saved tensor "
        "(unset: false; torch's own check still runs, unnamed). full and selective."
    ),
    "segments": (
        "Checkpoint a chain of consecutive layers in segments: a count, sqrt or recursive (unset: one checkpoint "
        "per layer). full and selective. optimal (full): the nesting of regions with the least recomputation that "
        "fits budget."
    ),
    "offload": (
        "Keep what checkpointing still saves (the layers' inputs) in CPU memory (unset: false). full and selective. "
        "auto: whether a layer may be planned offload or full+offload, priced by the copy time the step cannot hide "
        "(unset: true; chosen only where a host link is measured: a GPU)."
    ),
    "policy": (
        "selective: the ops whose outputs are saved: matmuls, matmuls_no_batch, names (the tensors tagged with "
        "checkpoint_name) or a list of aten op names (unset: matmuls)."
    ),
    "save_names": "selective with policy names: save exactly the checkpoint_name tensors named here.",
    "exclude_names": "selective with policy names: save every checkpoint_name tensor except these.",
    "budget": (
        "auto (or memory instead), and full with segments optimal, required there: the activation memory to fit, a "
        "fraction of the peak without checkpointing (0.4, 40%), a size (2GiB, 512MiB), or min (the least peak "
        "reachable)."
    ),
    "memory": (
        "auto, instead of budget: the device memory the whole step must fit on one rank (parameters, gradients, "
        "optimizer state, activations and temporaries), a size (70GiB, 500MB), device (the accelerator's total "
        "memory less a 5% margin) or a fraction of that total (0.9, 90%; CUDA only)."
    ),
    "batch": (
        "auto with memory: null (the batch the dataloader has) or max (the largest micro-batch whose whole step "
        "fits memory, found by planning; it sets the train dataloader's batch size, as Lightning's "
        "BatchSizeFinder does) (unset: null)."
    ),
    "deepspeed": (
        "full: DeepSpeed's own checkpoint, under a DeepSpeed strategy, with these options (partition_activations, "
        "cpu_checkpointing, contiguous_memory_optimization, number_checkpoints, synchronize_checkpoint_boundary, "
        "profile) (unset: torch's checkpoint)."
    ),
    "compile": (
        "Run each wrapped layer compiled, its checkpoint included (regional compilation): true (inductor), false, "
        "or the name of a torch.compile backend (aot_eager) (unset: false). Not with segments, deepspeed, "
        "check_recompute or policy names."
    ),
    "timing": (
        "ckpt=auto: how each option is timed for the plan (unset: auto, as the step runs: compiled where "
        "ckpt.compile or your own torch.compile compiles it), eager, compiled (inductor) or a backend name."
    ),
    "plan": (
        "ckpt=auto: the path of a plan file (the ckpt_plan.json a ckpt=auto run writes in the Trainer's log dir) "
        "to install as it is, without planning; layers and budget (or memory) are then not needed (unset: plan)."
    ),
}


def args_section(indent: str = "    ") -> str:
    """A Google-style ``Args:`` section of every key, for a docstring (jsonargparse reads it for ``--help``)."""
    import textwrap

    lines = [f"{indent}Args:"]
    for key, text in HELP.items():
        lines += textwrap.wrap(f"{key}: {text}", width=112, initial_indent=indent * 2,
                               subsequent_indent=indent * 3)
    return "\n".join(lines)


__all__ = ["HELP", "args_section"]
