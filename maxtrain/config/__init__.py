"""The one run config: its schema (schema.py, one module per section) and how it is loaded
(loading.py).

A run's config is assembled in a fixed order, later layers winning key by key:

    configs/base.yml <- configs/models/<model_name>.yml <- the config file given <- CLI key=value

Keys of an older maxtrain (before `compute:`) are migrated to the current ones as each file,
override or saved config is read, with a one-line note (migration.py).

A config file may name a parent with ``base_config:`` (resolved recursively, relative to the
file); the data files it names, when relative, are found beside it too (loading.py
_data_paths_beside), while command-line overrides are relative to the working directory.
Every key is declared in the pydantic schema; an unknown key is an error that suggests the
closest valid one.
"""

from maxtrain.config.checkpoint import CheckpointConfig, CheckpointTier, InitConfig
from maxtrain.config.compute import ComputeConfig, named_tiles
from maxtrain.config.data import EMBEDDED_SOURCES, DataConfig, DataSource
from maxtrain.config.layer_list import LayerType
from maxtrain.config.loading import (
    CONFIGS_DIR,
    REPO_ROOT,
    ConfigError,
    deep_merge,
    load,
    overridden,
    parse_override,
    preset,
    preset_names,
    to_yaml,
    validate,
    validate_model,
    validate_saved,
)
from maxtrain.config.lora import LoraConfig
from maxtrain.config.model import (
    AttentionTemperature,
    IndexerConfig,
    LinearAttention,
    MlaConfig,
    ModelConfig,
    MtpConfig,
)
from maxtrain.config.moe import ClampedSwiglu, MoeConfig
from maxtrain.config.optim import OptimConfig
from maxtrain.config.parallel import MESH_AXES, DcnAxes, MeshAxes, MeshConfig, PipelineConfig
from maxtrain.config.quantization import QType, QuantizationConfig, QuantRule
from maxtrain.config.rope import RopeConfig, RopeScaling
from maxtrain.config.run import DistributedConfig, ProfileConfig, RunConfig, TrainConfig
from maxtrain.config.schema import Config

__all__ = [
    "CONFIGS_DIR",
    "REPO_ROOT",
    "ConfigError",
    "deep_merge",
    "load",
    "overridden",
    "parse_override",
    "preset",
    "preset_names",
    "to_yaml",
    "validate",
    "validate_model",
    "validate_saved",
    "AttentionTemperature",
    "CheckpointConfig",
    "CheckpointTier",
    "Config",
    "DataConfig",
    "ClampedSwiglu",
    "ComputeConfig",
    "DataSource",
    "DcnAxes",
    "DistributedConfig",
    "EMBEDDED_SOURCES",
    "InitConfig",
    "LayerType",
    "LinearAttention",
    "MESH_AXES",
    "MeshAxes",
    "MeshConfig",
    "ModelConfig",
    "IndexerConfig",
    "MlaConfig",
    "MoeConfig",
    "MtpConfig",
    "OptimConfig",
    "PipelineConfig",
    "ProfileConfig",
    "QType",
    "QuantRule",
    "QuantizationConfig",
    "LoraConfig",
    "RopeConfig",
    "RopeScaling",
    "named_tiles",
    "RunConfig",
    "TrainConfig",
]
