"""Train a model with activation checkpointing, configured by Hydra.

    python recipes/train.py                                    # embedded GPT on CPU, TransformerBlocks checkpointed
    python recipes/train.py ckpt.layers=TransformerBlock ckpt.every_n=2
    python recipes/train.py model=resnet ckpt.layers=ResStage
    python recipes/train.py ckpt=none                          # the same run without checkpointing
    python recipes/train.py trainer=ddp trainer.accelerator=cpu trainer.devices=2
    python recipes/train.py 'callbacks=[activation_checkpointing,model_checkpoint]' ckpt_path=last   # resumable
    python recipes/train.py --help                             # the groups to choose from, and the config

Configs: ``recipes/configs/`` (``train.yaml``; the groups ``trainer``,
``callbacks/model_checkpoint`` and ``hydra/launcher``). The ``ckpt`` group and
``callbacks/activation_checkpointing`` come from the installed plugin, the
example ``model`` and ``data`` groups from ``ckpt_examples`` (``hydra.searchpath``
in ``train.yaml``). :func:`train` is the whole recipe; ``main`` only hands it
Hydra's config, so tests and launchers call ``train(cfg)`` directly.
"""

from __future__ import annotations

from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from omegaconf import DictConfig, OmegaConf

from ckpt_plugin.lightning.app import check_app_config, config_errors_exit, config_groups
from ckpt_plugin.runs.resume import latest_checkpoint


def processes(devices: Any, num_nodes: Any = 1) -> int:
    """How many processes a Trainer with ``devices`` on ``num_nodes`` starts, as Lightning counts them.

    ``trainer=model_parallel`` needs it (``${processes:...}``): ModelParallelStrategy's "auto"
    data-parallel size is the number of nodes (the rest goes to tensor parallelism), but a model
    without tensor parallelism (FSDP2 alone) wants every process data-parallel.
    """
    if isinstance(devices, list | tuple) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        per_node = len(devices)
    elif str(devices) in ("auto", "-1"):
        import torch

        per_node = torch.cuda.device_count() or 1  # Lightning's auto: every GPU, else one CPU process
    elif isinstance(devices, str) and "," in devices:
        per_node = len([d for d in devices.split(",") if d.strip()])
    else:
        per_node = int(devices)
    return per_node * int(num_nodes)


OmegaConf.register_new_resolver("processes", processes, replace=True)
OmegaConf.register_new_resolver("config_groups", config_groups, replace=True)  # --help: train.yaml's hydra.help


class StepsRichProgressBar(RichProgressBar):
    """Lightning's rich bar without ``Epoch 0/-2`` when steps bound the run (``max_epochs=-1``).

    Lightning 2.6 writes the epoch total as ``max_epochs - 1`` even for -1 (Lightning#21925, fixed by
    Lightning#21924 in 2.7). Its TQDM bar, used when ``rich`` is not installed, shows ``Epoch 0`` already.
    """

    def _get_train_description(self, current_epoch: int) -> str:
        text = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            text = text.replace(f"Epoch {current_epoch}/{self.trainer.max_epochs - 1}", f"Epoch {current_epoch}")
        return text


def train(cfg: DictConfig, model: pl.LightningModule | None = None) -> pl.Trainer:
    """Fit ``cfg.model`` (or ``model``) on ``cfg.data`` with ``cfg.callbacks`` and ``cfg.trainer``; the Trainer after fit."""
    check_app_config(cfg)  # the ckpt keys and the strategy, before anything is built
    pl.seed_everything(cfg.seed, workers=True)
    rank_zero_info(f"Instantiating datamodule <{cfg.data._target_}>")
    datamodule = instantiate(cfg.data)
    if model is None:
        rank_zero_info(f"Instantiating model <{cfg.model._target_}>")
        model = instantiate(cfg.model)
    callbacks = []
    for name, node in (cfg.get("callbacks") or {}).items():
        rank_zero_info(f"Instantiating callback {name} <{node._target_}>")
        callbacks.append(instantiate(node))
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(StepsRichProgressBar() if _RICH_AVAILABLE else TQDMProgressBar())  # Lightning's choice
    rank_zero_info(f"Instantiating trainer <{cfg.trainer._target_}>")
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    # ckpt_path=last resumes from the newer of ModelCheckpoint's last.ckpt and the hpc checkpoint
    # that a SLURM requeue saved (else starts afresh, as Lightning says): the same command starts
    # a run and restarts it after a kill, a preemption or a requeue.
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path == "last":
        ckpt_path = latest_checkpoint(trainer) or "last"
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def release_process_group() -> None:
    """Destroy the default process group, if training made one, before the interpreter shuts down.

    Lightning leaves a gloo group alive at exit, and gloo's threads may then abort the finished process
    ("terminate called without an active exception", exit code -6; pytorch#190489): seen under trainer=ddp
    on CPU when the machine is busy.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    with config_errors_exit():  # a ckpt mistake: the message alone, exit code 2 (HYDRA_FULL_ERROR=1: traceback)
        train(cfg)
    release_process_group()


if __name__ == "__main__":
    main()
