"""The one run config: its schema (schema.py) and how it is loaded (loading.py).

A run's config is assembled in a fixed order, later layers winning key by key:

    configs/base.yml <- configs/models/<model_name>.yml <- the config file given <- CLI key=value

A config file may name a parent with ``base_config:`` (resolved recursively, relative to the
file). Every key is declared in the pydantic schema; an unknown key is an error that suggests
the closest valid one.
"""

from maxtrain.config.loading import (
    CONFIGS_DIR,
    REPO_ROOT,
    ConfigError,
    deep_merge,
    load,
    parse_override,
    to_yaml,
    validate,
)
from maxtrain.config.schema import (
    EMBEDDED_SOURCES,
    MESH_AXES,
    CheckpointConfig,
    CheckpointTier,
    Config,
    DataConfig,
    DataSource,
    DcnAxes,
    DistributedConfig,
    InitConfig,
    MeshAxes,
    MeshConfig,
    ModelArchitecture,
    ModelConfig,
    MoeConfig,
    OptimConfig,
    PipelineConfig,
    ProfileConfig,
    QType,
    QuantizationConfig,
    QuantRule,
    RopeScaling,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "CONFIGS_DIR",
    "REPO_ROOT",
    "ConfigError",
    "deep_merge",
    "load",
    "parse_override",
    "to_yaml",
    "validate",
    "CheckpointConfig",
    "CheckpointTier",
    "Config",
    "DataConfig",
    "DataSource",
    "DcnAxes",
    "DistributedConfig",
    "EMBEDDED_SOURCES",
    "InitConfig",
    "MESH_AXES",
    "MeshAxes",
    "MeshConfig",
    "ModelArchitecture",
    "ModelConfig",
    "MoeConfig",
    "OptimConfig",
    "PipelineConfig",
    "ProfileConfig",
    "QType",
    "QuantRule",
    "QuantizationConfig",
    "RopeScaling",
    "RunConfig",
    "TrainConfig",
]
