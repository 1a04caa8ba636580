"""Issue #34's Llama: ``ckpt.memory`` on a Hugging Face Llama of 246 M parameters, planned, then one real step.

    python -m ckpt_tools.llama_fit                       # ckpt.memory=4.5GB, AdamW: about 12 minutes on 2 cores
    python -m ckpt_tools.llama_fit --memory 4.4GB --no-real

The model: 16 ``LlamaDecoderLayer``s of width 1024 (MLP 2304, 16 heads), vocabulary 32,000, 1,024 tokens,
batch 1, fp32, trained on its own causal-LM loss with AdamW. Printed: the whole step (``measure/whole_step.py``,
fake tensors) without checkpointing and with every layer ``full``, without and with the optimizer; then
``plan_for(... memory=...)``'s summary with the planning time and the process's peak-RSS growth while planning;
then (unless ``--no-real``) the plan installed and one real whole step measured with MemTracker (about 6 GB of
host memory), against the prediction and the limit.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Sequence

import torch

from ckpt_plugin.apply.install import install_plan
from ckpt_plugin.apply.memory import whole_of
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.measure.whole_step import whole_step
from ckpt_plugin.units import parse_size


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="4.5GB", help="ckpt.memory: the whole step's limit (default 4.5GB)")
    parser.add_argument("--no-real", action="store_true", help="plan only: no real step (which needs ~6 GB)")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2304, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024,
                         use_cache=False)
    model = LlamaForCausalLM(config).train()
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    ids = torch.randint(config.vocab_size, (1, 1024))

    def forward() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    full = plan_for(model, make_config(layers="LlamaDecoderLayer"))
    for optimizers, said in (([], "no optimizer"), ([optimizer], "AdamW")):
        for name, plan in (("none", WrapPlan()), ("full", full)):
            print(f"{name}, {said}: whole step {whole_of(model, plan, forward, optimizers)}", flush=True)
    limit = parse_size(args.memory) or int(args.memory)
    start, rss = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    plan = plan_for(model, make_config(mode="auto", layers="LlamaDecoderLayer", memory=f"{limit}B"), forward,
                    optimizers=[optimizer])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    print(f"ckpt.memory={args.memory}: planned in {time.perf_counter() - start:.0f} s, the process's peak RSS grew "
          f"by {grown / 1024:.0f} MiB (the timing's real step with every layer full included)")
    print(plan.summary, flush=True)
    if args.no_real:
        return 0
    install_plan(model, plan)
    start = time.perf_counter()
    real = whole_step(model, forward, [optimizer], fake=False)
    predicted = plan.fit.split.peak
    print(f"real whole step (MemTracker, {time.perf_counter() - start:.0f} s): {real}; <= limit: "
          f"{'yes' if real.peak <= limit else 'NO'}; predicted {predicted} B, {predicted / real.peak:.4f} of it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
