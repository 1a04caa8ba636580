"""``ckpt=auto``'s and ``segments=optimal``'s plans on the test suite's GPT and ResNet, as data, with every
timing replaced by a fixed clock: what a refactor must leave byte for byte the same.

    cd <checkout A> && python /path/to/ckpt_tools/fixed_clock_plans.py > a.txt
    cd <checkout B> && python /path/to/ckpt_tools/fixed_clock_plans.py > b.txt && diff a.txt b.txt

``ckpt=auto`` chooses by measured step time, so two runs on a loaded machine may choose
differently; with the clock fixed, only the code decides. Runs the checkout it is started
from (its working directory first on the path), old layouts included.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import sys
from typing import Any

CASES = [("auto", b) for b in ("0.9", "0.6", "0.45", "0.3", "0.2", "0.12", "0.05", "min")] + [("full", "0.6"),
                                                                                             ("full", "min")]


def _fixed_clock(measure: Any) -> Any:
    def measured(*args: Any, **kwargs: Any) -> Any:
        ticks = itertools.count()
        kwargs["clock"] = lambda: next(ticks) * 1e-3  # every call takes 1 ms: ties go as the code breaks them
        return measure(*args, **kwargs)
    return measured


def main() -> None:
    sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]  # the checkout this runs in, old ones too
    import torch

    import ckpt_plugin.planning.profile as prof
    from ckpt_plugin.config.schema import make_config
    from ckpt_plugin.errors import ConfigError
    from ckpt_plugin.planning.plan_file import plan_to_dict
    from conftest import gpt_batch, resnet_batch, small_gpt, small_resnet
    try:
        from ckpt_plugin.apply.plan import plan_for
    except ImportError:  # before the spine (issue #32)
        from ckpt_plugin.config.plan import plan_for

    print("# from", prof.__file__, file=sys.stderr)
    prof.measure_layer_times = _fixed_clock(prof.measure_layer_times)
    torch.set_num_threads(1)
    models = {"gpt": (small_gpt, gpt_batch, "TransformerBlock"), "resnet": (small_resnet, resnet_batch, "Bottleneck")}
    for name, (make, batch_of, layers) in models.items():
        for mode, budget in CASES:
            torch.manual_seed(0)
            model = make()
            batch = batch_of(model)
            keys = dict(mode=mode, layers=layers, budget=budget) | ({"segments": "optimal"} if mode == "full" else {})
            print(f"===== {name} {mode} budget={budget}")
            try:
                plan = plan_for(model, make_config(**keys), lambda: model.loss(batch))  # noqa: B023
            except ConfigError as err:
                print("refused; least peak reachable:", re.search(r"peak .*?(?:reachable|reaches) is (\d+) bytes",
                                                                    str(err))[1])
                continue
            kept = {k: v for k, v in plan_to_dict(plan, model).items() if k not in ("plugin", "torch", "version")}
            print(json.dumps(kept, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
