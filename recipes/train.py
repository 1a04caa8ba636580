"""Train a model with activation checkpointing, configured by Hydra.

    python recipes/train.py                                    # embedded GPT on CPU, TransformerBlocks checkpointed
    python recipes/train.py ckpt.layers=TransformerBlock ckpt.every_n=2
    python recipes/train.py model=resnet ckpt.layers=ResStage
    python recipes/train.py ckpt=none                          # the same run without checkpointing
    python recipes/train.py trainer=ddp trainer.accelerator=cpu trainer.devices=2
    python recipes/train.py 'callbacks=[activation_checkpointing,model_checkpoint]' ckpt_path=last   # resumable

Configs: configs/ (train.yaml and the groups ckpt, callbacks, model, data, trainer).
"""

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig

from ckpt_plugin.resume import latest_checkpoint


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    pl.seed_everything(cfg.seed, workers=True)
    rank_zero_info(f"Instantiating datamodule <{cfg.data._target_}>")
    datamodule = instantiate(cfg.data)
    rank_zero_info(f"Instantiating model <{cfg.model._target_}>")
    model = instantiate(cfg.model)
    callbacks = []
    for name, node in (cfg.get("callbacks") or {}).items():
        rank_zero_info(f"Instantiating callback {name} <{node._target_}>")
        callbacks.append(instantiate(node))
    rank_zero_info(f"Instantiating trainer <{cfg.trainer._target_}>")
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    # ckpt_path=last resumes from the newer of ModelCheckpoint's last.ckpt and the hpc checkpoint
    # that a SLURM requeue saved (else starts afresh, as Lightning says): the same command starts
    # a run and restarts it after a kill, a preemption or a requeue.
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path == "last":
        ckpt_path = latest_checkpoint(trainer) or "last"
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
