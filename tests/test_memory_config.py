"""``ckpt.memory`` and ``ckpt.batch`` (issue #34), as the config reads them: every form of ``ckpt.memory`` into
its exact bytes or share of the device, each mistake as its whole message, the rules ckpt=auto sets between
ckpt.budget, ckpt.memory and ckpt.batch, and the keys taken by ``make_config``, the callback and the recipe's
Hydra composition. What the keys do (planning for the whole step, the batch search) is tested elsewhere."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_train
from hydra.utils import instantiate

from ckpt_plugin import ActivationCheckpointing
from ckpt_plugin.config.memory import Memory, parse_memory, resolve_memory
from ckpt_plugin.config.schema import AutoConfig, make_config
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.lightning.app import check_app_config
from ckpt_plugin.units import parse_size

FORMS = ("valid: a size (70GiB, '70 GiB', 500MB, or an integer number of bytes), device (the accelerator's total "
         "memory less a 5% margin) or a fraction of that total (0.9, 90%)")
UNITS = "a size's unit is B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024), in any case"
BOTH = ("ckpt.memory='2GiB' cannot be combined with ckpt.budget=0.5: ckpt.budget is the activation memory alone (a "
        "share of the peak without checkpointing, or a size), ckpt.memory the device memory the whole step must fit "
        "on one rank (parameters, gradients, optimizer state, activations); drop one of the two")
NEITHER = ("ckpt=auto needs ckpt.budget: a fraction of the activation peak without checkpointing (0.4) or a size "
           "(2GiB), or ckpt.memory: the device memory for the whole step (70GiB, device)")
BATCH_FOUR = ("ckpt.batch=4 (int) must be null (the batch the dataloader has) or max (the largest micro-batch whose "
              "whole step fits ckpt.memory); a batch size of 4 is the dataloader's own setting (its batch_size)")
BATCH_ALONE = ("ckpt.batch=max needs ckpt.memory: the device memory the whole step must fit (70GiB, device), which "
               "the largest micro-batch is searched against; set ckpt.memory, or drop ckpt.batch to train on the "
               "dataloader's batch")


def _message(call, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        call(*args, **kwargs)
    return str(err.value)


# ---------------------------------------------------------------------- every form, read

@pytest.mark.parametrize(("given", "expected"), [
    ("70GiB", Memory(bytes=70 * 2**30)),
    ("70 GiB", Memory(bytes=70 * 2**30)),
    (" 70 gib ", Memory(bytes=70 * 2**30)),
    ("500MB", Memory(bytes=500 * 10**6)),
    ("1.5GB", Memory(bytes=1_500_000_000)),
    ("8_GiB", Memory(bytes=8 * 2**30)),  # an underscore is dropped, as in ckpt.budget
    (3 * 2**30, Memory(bytes=3 * 2**30)),  # an int is bytes
    ("device", Memory(fraction=0.95)),
    ("DEVICE", Memory(fraction=0.95)),
    (0.9, Memory(fraction=0.9)),
    ("0.9", Memory(fraction=0.9)),
    ("90%", Memory(fraction=0.9)),
    (1.0, Memory(fraction=1.0)),
    (1, Memory(fraction=1.0)),  # ckpt.memory=1 on a command line is an int: the whole device, not 1 byte
])
def test_every_form_is_read_into_its_bytes_or_share(given, expected) -> None:
    assert parse_memory(given) == expected
    assert parse_memory(given, typed=True) == expected


def test_a_size_is_read_as_ckpt_budget_reads_one() -> None:
    # One parser for both keys (units.py): the same text is the same bytes.
    from ckpt_plugin.config.budget import parse_budget

    for text in ("70GiB", "70 GiB", "500MB", "1.5GB", "512 kib", "3TB"):
        assert parse_memory(text).bytes == parse_budget(text).bytes == parse_size(text)
    assert parse_size("70") is None and parse_size("-1GiB") is None and parse_size("3 GiBs") is None


def test_str_says_what_was_typed() -> None:
    assert str(parse_memory("70GiB")) == "70 GiB"
    assert str(parse_memory("500MB")) == "500 MB"
    assert str(parse_memory("device")) == "device (0.95 of the device's memory)"
    assert str(parse_memory("90%")) == "0.9 of the device's memory"
    assert str(parse_memory(2**30 + 1)) == "1073741825 bytes (1.0 GiB)"


# ---------------------------------------------------------------------- every mistake, its whole message

@pytest.mark.parametrize(("given", "message"), [
    ("70 GiBs", f"ckpt.memory='70 GiBs' is not a memory: write {FORMS.removeprefix('valid: ')}; {UNITS}"),
    ("lots", f"ckpt.memory='lots' is not a memory: write {FORMS.removeprefix('valid: ')}; {UNITS}"),
    ("-8GiB", f"ckpt.memory='-8GiB' must be positive; {FORMS}"),
    (-3, f"ckpt.memory=-3 must be positive; {FORMS}"),
    (0, f"ckpt.memory=0 must be positive; {FORMS}"),
    ("0GiB", f"ckpt.memory='0GiB' must be positive; {FORMS}"),
    (1.5, f"ckpt.memory=1.5: a fraction of the device's memory must be in (0, 1]; for a size write e.g. 1.5GiB; "
          f"{FORMS}"),
    ("70", f"ckpt.memory='70': a fraction of the device's memory must be in (0, 1]; for a size write e.g. 70GiB; "
           f"{FORMS}"),
    ("150%", f"ckpt.memory='150%': a fraction of the device's memory must be in (0, 1]; at most 100%; {FORMS}"),
    (True, f"ckpt.memory=True (bool) must be a size (70GiB), device or a fraction (0.9); {FORMS}"),
    ([8], f"ckpt.memory=[8] (list) must be a size (70GiB), device or a fraction (0.9); {FORMS}"),
])
def test_a_wrong_memory_is_named_with_the_valid_forms(given, message) -> None:
    assert _message(parse_memory, given) == message


def test_a_typed_integer_below_one_mib_is_a_slip_but_computed_bytes_are_not() -> None:
    assert _message(parse_memory, 70, typed=True) == (
        "ckpt.memory=70 would be 70 bytes (an integer is a number of bytes): did you mean a size with a unit?; "
        f"write e.g. 70GiB, device or 0.9, or 70B if 70 bytes are meant; {FORMS}")
    assert parse_memory(70) == Memory(bytes=70)  # in Python, a byte count computed is taken as it is
    assert parse_memory(2**20, typed=True) == Memory(bytes=2**20)
    assert parse_memory("70B", typed=True) == Memory(bytes=70)


# ---------------------------------------------------------------------- resolved on a device

def test_a_size_resolves_to_itself_on_any_device() -> None:
    assert resolve_memory(parse_memory("2GiB"), torch.device("cpu")) == 2 * 2**30
    assert resolve_memory(parse_memory("2GiB"), "meta") == 2 * 2**30


@pytest.mark.parametrize(("given", "typed"), [("device", "device"), ("90%", "0.9"), (0.5, "0.5")])
def test_a_share_of_the_device_on_cpu_asks_for_a_size(given, typed) -> None:
    assert _message(resolve_memory, parse_memory(given), torch.device("cpu")) == (
        f"ckpt.memory={typed} is a share of the accelerator's total memory, which a cpu device does not report: "
        "on cpu ckpt.memory must be given as a size; e.g. ckpt.memory=8GiB (the memory the whole step may use on "
        "one rank)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_share_of_a_cuda_device_is_of_its_total_memory() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    assert resolve_memory(parse_memory("device"), torch.device("cuda", 0)) == int(0.95 * total)
    assert resolve_memory(parse_memory("50%"), "cuda:0") == int(0.5 * total)


# ---------------------------------------------------------------------- ckpt=auto: budget, memory, batch

def test_auto_takes_memory_instead_of_budget() -> None:
    config = make_config(mode="auto", layers="Block", memory="2GiB")
    assert isinstance(config, AutoConfig)
    assert (config.read_memory, config.read_budget, config.batch) == (Memory(bytes=2 * 2**30), None, None)
    config = make_config(mode="auto", layers="Block", memory="device", batch="max")
    assert (config.read_memory, config.batch) == (Memory(fraction=0.95), "max")
    budget = make_config(mode="auto", layers="Block", budget=0.4)
    assert budget.read_memory is None and budget.read_budget is not None


def test_auto_with_both_budget_and_memory_says_what_each_means() -> None:
    assert _message(make_config, mode="auto", layers="Block", memory="2GiB", budget=0.5) == BOTH


@pytest.mark.parametrize("budget", [None, "???", ""])
def test_auto_with_neither_names_both(budget) -> None:
    assert _message(make_config, mode="auto", layers="Block", budget=budget) == NEITHER
    assert make_config(mode="auto", layers="Block", budget=budget, memory="8GiB").read_memory == Memory(bytes=8 * 2**30)


def test_auto_with_a_plan_file_needs_neither(tmp_path) -> None:
    plan = tmp_path / "ckpt_plan.json"
    plan.write_text("{}")
    assert make_config(mode="auto", plan=str(plan)).read_memory is None
    assert make_config(mode="auto", plan=str(plan), memory="8GiB").read_memory == Memory(bytes=8 * 2**30)


def test_batch_is_null_or_max_and_max_needs_memory() -> None:
    assert _message(make_config, mode="auto", layers="Block", memory="8GiB", batch=4) == BATCH_FOUR
    assert _message(make_config, mode="auto", layers="Block", memory="8GiB", batch="MAX") == (
        "ckpt.batch='MAX' (str) must be null (the batch the dataloader has) or max (the largest micro-batch whose "
        "whole step fits ckpt.memory)")
    assert _message(make_config, mode="auto", layers="Block", budget=0.4, batch="max") == BATCH_ALONE


def test_every_problem_is_raised_together() -> None:
    with pytest.raises(ConfigError) as err:
        make_config(mode="auto", layers="Block", memory="2GiB", budget=0.5, batch=4)
    assert err.value.keys == ["ckpt.memory", "ckpt.batch"]


def test_the_other_modes_do_not_take_memory_or_batch_but_none_accepts_them() -> None:
    message = _message(make_config, mode="full", layers="Block", memory="2GiB")
    assert message.startswith("unknown key ckpt.memory for ckpt mode 'full'; valid keys: ")
    assert make_config(mode="none", memory="2GiB", batch="max").mode == "none"


# ---------------------------------------------------------------------- the callback and the recipe's Hydra config

def test_the_callback_takes_both_keys() -> None:
    callback = ActivationCheckpointing(mode="auto", layers="Block", memory="2GiB", batch="max")
    assert (callback.config.read_memory, callback.config.batch) == (Memory(bytes=2 * 2**30), "max")


def test_the_auto_preset_composes_with_memory_and_batch() -> None:
    cfg = compose_train("ckpt=auto", "ckpt.memory=2GiB", "ckpt.batch=max")
    check_app_config(cfg)
    callback = instantiate(cfg.callbacks.activation_checkpointing)
    assert (callback.config.read_memory, callback.config.batch) == (Memory(bytes=2 * 2**30), "max")


def test_the_app_check_reads_memory_as_typed() -> None:
    with pytest.raises(ConfigError) as err:
        check_app_config(compose_train("ckpt=auto", "ckpt.memory=70"))
    assert str(err.value).startswith("ckpt.memory=70 would be 70 bytes (an integer is a number of bytes)")
    with pytest.raises(ConfigError) as err:
        check_app_config(compose_train("ckpt=auto", "ckpt.memory=2GiB", "ckpt.budget=0.5"))
    assert str(err.value) == BOTH
