"""The check both zoo test files make of ``ckpt=auto ckpt.budget=0.5`` on a zoo entry (issues #33 and #42)."""

from __future__ import annotations

from torch import nn

from ckpt_tools.zoo import ZooModel
from ckpt_tools.zoo.measure import BudgetResult, _train, at_budget


def met_or_its_least(entry: ZooModel, model: nn.Module, refused: bool) -> BudgetResult:
    """Plan ``entry`` at half the activation peak of ``model`` (the entry's build, trained without checkpointing):
    refused (``refused``) with a least that, typed back in bytes, holds the step, or met; bitwise either way."""
    none = _train(entry, model)
    result = at_budget(entry, 0.5, none)
    assert (result.refused is not None) == refused, result.refused
    if refused:  # the refusal's least, typed back in bytes, is the limit the step is held to
        assert result.least == result.limit and result.least < none.act_peak
    else:
        assert result.limit == int(0.5 * none.act_peak)
    assert result.mismatches == []  # loss, every gradient and buffer bitwise those without checkpointing
    assert result.run.act_peak <= result.limit, (result.run.act_peak, result.limit)
    return result
