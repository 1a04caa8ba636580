"""Each key of the ``ckpt`` node is written once (issue #32): its help in ``config/keys.py``, which the callback's
docstring, LightningCLI's ``--help`` and the docs' key reference are built from, and the callback's signature has
exactly the schema's keys."""

from __future__ import annotations

import inspect
from dataclasses import fields

from ckpt_plugin import ActivationCheckpointing
from ckpt_plugin.config.keys import HELP
from ckpt_plugin.config.reference import markdown
from ckpt_plugin.config.schema import MODES


def _schema_keys() -> set[str]:
    return {f.name for cls in MODES.values() for f in fields(cls)}


def test_every_key_of_every_mode_has_its_help_and_no_help_names_a_key_that_is_gone() -> None:
    assert set(HELP) == _schema_keys()


def test_the_callbacks_signature_takes_exactly_the_schemas_keys() -> None:
    params = inspect.signature(ActivationCheckpointing.__init__).parameters
    named = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert named == _schema_keys()


def test_the_callbacks_docstring_carries_each_keys_help() -> None:
    doc = " ".join(ActivationCheckpointing.__doc__.split())
    for key, text in HELP.items():
        assert f"{key}: {' '.join(text.split())}" in doc, key


def test_the_reference_has_one_row_a_key_with_the_modes_that_take_it() -> None:
    rows = [line for line in markdown().splitlines()[2:]]
    assert [row.split("|")[1].strip() for row in rows] == [f"`{k}`" for k in HELP]
    budget = next(row for row in rows if row.startswith("| `budget`"))
    assert budget.split("|")[2].strip() == "`full`, `auto` (`null`)"
    policy = next(row for row in rows if row.startswith("| `policy`"))
    assert policy.split("|")[2].strip() == "`selective` (`matmuls`)"
