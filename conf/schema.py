"""The structured config behind ``conf/``: one dataclass per group, registered with Hydra.

Registering the dataclasses makes every YAML file and command-line override type-checked:
an unknown key or a value of the wrong type fails before anything runs, naming the key.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from mindmoe.data.config import DataConfig
from mindmoe.launch.config import LaunchConfig, ParallelConfig, PlanConfig
from mindmoe.model.config import ModelConfig
from mindmoe.model.dsa_config import DSATrainingConfig
from mindmoe.model.lora import LoraConfig
from mindmoe.model.moe_config import MoEConfig
from mindmoe.train.config import TrainConfig
from mindmoe.train.evaluation.config import EvalConfig
from mindmoe.train.export.config import ExportConfig

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "data" / "samples"


@dataclass
class Config:
    #: The architecture (what a checkpoint's ``config.json`` / ``state.json`` stores) and where it comes from.
    model: ModelConfig = field(default_factory=ModelConfig)
    #: MoE training policy: token dispatch, balancing losses, bias update, expert locking.
    moe: MoEConfig = field(default_factory=MoEConfig)
    #: DeepSeek Sparse Attention's training schedule: stage, warm-up steps, indexer loss weight.
    dsa: DSATrainingConfig = field(default_factory=DSATrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    #: Planner-only keys of ``mindmoe-plan`` (tensor/pipeline degrees, ZeRO, recompute, device memory).
    plan: PlanConfig = field(default_factory=PlanConfig)
    #: Keys of ``mindmoe-eval`` (context lengths, RoPE scaling types, attention mode, output).
    eval: EvalConfig = field(default_factory=EvalConfig)
    #: Keys of ``mindmoe-export`` (format, output directory, dtype, Ascend converter gears).
    export: ExportConfig = field(default_factory=ExportConfig)
    #: LoRA fine-tuning: adapters on a frozen base (r, alpha, dropout, rslora, target_modules, ...).
    lora: LoraConfig = field(default_factory=LoraConfig)
    #: Keys of ``mindmoe-launch`` (nodes, workers per node, scheduler address, timeouts, HCCL environment).
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    #: Input checkpoint directory for commands that read one (export, eval).
    checkpoint: Optional[str] = None


def register_configs() -> None:
    if not OmegaConf.has_resolver("samples"):
        # The bundled sample data, wherever the package is installed.
        OmegaConf.register_new_resolver("samples", lambda: str(SAMPLES_DIR))
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="model", name="base_model", node=ModelConfig)
    store.store(group="data", name="base_data", node=DataConfig)
    store.store(group="train", name="base_train", node=TrainConfig)
    store.store(group="parallel", name="base_parallel", node=ParallelConfig)
    store.store(group="plan", name="base_plan", node=PlanConfig)
    store.store(group="eval", name="base_eval", node=EvalConfig)
    store.store(group="export", name="base_export", node=ExportConfig)
    store.store(group="launch", name="base_launch", node=LaunchConfig)
