"""Post-training as plug-ins: the one place a run's objective and parameter split are picked.

The loop, the step and the state know only the contracts (training/objectives.py Objective,
training/split.py ParameterSplit). What post-training adds implements them here: DPO's
objective and frozen reference (dpo.py), GRPO's objective (grpo.py; its rollouts, which sample
with maxtrain.inference, sit above training in rollout.py), LoRA/QLoRA's adapters on a frozen
base (lora.py, imported only when asked for: Qwix takes seconds to import), DeepSeek sparse
attention's indexer warm-up on a frozen model (indexer_warmup.py), and the merge of a split's
checkpoint into a plain model (merging.py).
"""

from __future__ import annotations

from maxtrain.config import Config, TrainConfig
from maxtrain.posttrain.dpo import DPO, ReferenceCopy
from maxtrain.posttrain.grpo import GRPO
from maxtrain.posttrain.indexer_warmup import IndexerWarmup
from maxtrain.training.objectives import NEXT_TOKEN, Objective
from maxtrain.training.split import ParameterSplit, WholeModel

# The config keys (with every key under them) that choose a run's post-training: its objective
# and its split. A run's identity includes them (training/run_identity.py).
CONFIG_KEYS = ("train.task", "train.dpo", "train.grpo", "lora")


def objective(train: TrainConfig) -> Objective:
    """What train.task minimises: next-token loss (pretrain, sft), DPO's or GRPO's."""
    if train.task == "grpo":
        return GRPO(train.grpo)
    return DPO(train.dpo) if train.task == "dpo" else NEXT_TOKEN


def parameter_split(cfg: Config) -> ParameterSplit:
    """What the run trains and what it holds frozen: adapters on a frozen base (lora.rank > 0),
    the whole model beside a frozen reference copy (dpo, and grpo with a KL penalty), the
    indexers on a frozen model (DeepSeek sparse attention's warm-up), or the whole model."""
    if cfg.lora.enabled:
        from maxtrain.posttrain.lora import LoraSplit

        return LoraSplit(cfg.lora)
    if cfg.train.task == "dpo" or (cfg.train.task == "grpo" and cfg.train.grpo.kl != "none"):
        return ReferenceCopy()
    indexer = cfg.model.mla.indexer if cfg.model.mla else None
    if indexer is not None and indexer.stage == "warmup":
        return IndexerWarmup()
    return WholeModel()


def partial_checkpoint(step_dir: str, saved: dict) -> str | None:
    """Why a checkpoint, by the config saved with it (a dict, as read), holds less than a whole
    model and how to make one; None when it holds a whole model. A LoRA run's holds only its
    adapters: they merge into their base first."""
    rank = (saved.get("lora") or {}).get("rank")
    if not rank:
        return None
    return (
        f"checkpoint {step_dir} holds a LoRA run's adapters (lora.rank={rank}), not a whole "
        "model; merge them into their base first (python tools/merge_lora.py "
        f"{step_dir} MERGED) and export MERGED"
    )
