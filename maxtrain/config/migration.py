"""Keys of an older maxtrain, read as today's: configs, model files and checkpoints written
before `model:` held only the architecture still load, and a run saved then still resumes.

Each source (a config file, a model file, the command line's overrides, the config saved
with a checkpoint) is migrated as it is read (`migrate_source`): a moved or renamed key takes
its new place, and one line on stderr says what moved, once per source and process:

    maxtrain: note: run.yml: model.ep_dispatch is now compute.expert_exchange; ...

The old keys that together said what each layer is (model.layer_pattern, local_attention,
global_attention, model.moe.first_dense_layers and interval) combine over sources, a model
file's pattern with a command line's first dense layers, so they become model.layers and its
sizes once the sources are merged (`resolve`), as do the two that said the qk-norm
(qk_norm_scale) and the attention (attention_type); a later source that sets model.layers
itself replaces the layout keys before it (`without_layout`). `migrate` does both, for a config
that is one source (a checkpoint's, a model file read alone).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from maxtrain.config.errors import ConfigError
from maxtrain.config.layer_list import LayerType, layer_types, shortest_entries

# Old dotted key -> its new place; the value moves as it is.
MOVED = {
    "model.param_dtype": "compute.param_dtype",
    "model.compute_dtype": "compute.compute_dtype",
    "model.scan_layers": "compute.scan_layers",
    "model.remat": "compute.remat",
    "model.attention": "compute.attention",
    "model.attention_max_logit": "compute.attention_max_logit",
    "model.context_exchange": "compute.context_exchange",
    "model.context_layout": "compute.context_layout",
    "model.moe.grouped_matmul": "compute.grouped_matmul",
    "model.moe.grouped_matmul_tiles": "compute.grouped_matmul_tiles",
    "model.moe.ep_dispatch": "compute.expert_exchange",
    "model.moe.ep_capacity_factor": "compute.expert_exchange_capacity",
    "model.moe.ep_overflow": "compute.expert_exchange_overflow",
    "model.moe.balanced_routing": "compute.balanced_routing",
    "model.init_std": "init.std",
    "model.rope_theta": "model.rope.theta",
    "model.rope_scaling": "model.rope.scaling",
    "model.rope_interleaved": "model.rope.interleaved",
    "model.partial_rotary_factor": "model.rope.fraction",
    "model.attention_bias": "model.attention_projection_bias",
    "model.moe.router_bias": "model.moe.router_logit_bias",
    "model.moe.bias_update_rate": "model.moe.balance_bias_update_rate",
    "model.moe.expert_bias": "model.moe.expert_projection_bias",
    "model.moe.capacity_factor": "model.moe.expert_capacity_factor",
}
# Old keys that said what each layer is -> what says it now; kept through merging, then
# resolved together (`resolve`).
LAYOUT = {
    "model.layer_pattern": "model.layers",
    "model.local_attention": "model.layers' sliding or chunked layers with model.sliding_window "
    "or model.attention_chunk and model.rope.local_theta",
    "model.global_attention": "model.layers' nope layers with model.attention_temperature",
    "model.qk_norm_scale": "model.qk_norm rms_unscaled",
    "model.moe.first_dense_layers": "model.layers",
    "model.moe.interval": "model.layers",
}
# Old keys whose fact another key says now: checked against it (`resolve`), then dropped.
DROPPED = {"model.attention_type": "the presence of model.mla"}
_MODEL_LAYOUT = ("layer_pattern", "local_attention", "global_attention")
_MOE_LAYOUT = ("first_dense_layers", "interval")
_noted: set[str] = set()  # the notes printed by this process


def migrate(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """A whole config from one source (a checkpoint's, a model file's as {"model": ...}) in
    today's keys, with its note on stderr."""
    tree, notes = migrate_source(tree)
    note(source, notes)
    return resolve(tree)


def migrate_source(tree: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """One source's tree with its moved and renamed keys in their new places, its layout keys
    kept for `resolve`, and what moved ("model.ep_dispatch is now compute.expert_exchange"),
    for the source's `note`."""
    tree = copy.deepcopy(tree)
    notes = [*_dropped_unused(tree)] if _old_keys(tree) else []
    for old, new in MOVED.items():
        found, value = _pop(tree, old)
        if found:
            _put(tree, new, value)
            notes.append(f"{old} is now {new}")
    model = tree.get("model")
    if isinstance(model, dict) and isinstance(old := model.get("qk_norm"), bool):
        model["qk_norm"] = "rms" if old else "none"
        notes.append(f"model.qk_norm {str(old).lower()} is now {model['qk_norm']}")
    known = {**DROPPED, **LAYOUT}
    notes += [f"{old} is now {new}" for old, new in known.items() if _has(tree, old)]
    return tree, notes


def without_layout(tree: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """The tree less its old layout keys where `override`, a later source, sets model.layers:
    what config/loading.py merges the override into."""
    model, later = tree.get("model"), override.get("model")
    if not (isinstance(model, dict) and isinstance(later, dict) and "layers" in later):
        return tree
    model = {k: v for k, v in model.items() if k not in _MODEL_LAYOUT}
    if isinstance(model.get("moe"), dict):
        model["moe"] = {k: v for k, v in model["moe"].items() if k not in _MOE_LAYOUT}
    return {**tree, "model": model}


def resolve(tree: dict[str, Any]) -> dict[str, Any]:
    """The merged tree with the old layout keys turned into model.layers and its sizes."""
    model = tree.get("model")
    if not isinstance(model, dict):
        return tree
    model = dict(model)
    if (kind := model.pop("attention_type", None)) is not None:
        _check_attention_type(kind, model.get("mla"))
    if "qk_norm_scale" in model:
        scaled = model.pop("qk_norm_scale") is not False
        if model.get("qk_norm") in ("rms", "rms_unscaled"):
            model["qk_norm"] = "rms" if scaled else "rms_unscaled"
    legacy = {key: model.pop(key) for key in _MODEL_LAYOUT if key in model}
    if isinstance(model.get("moe"), dict):
        moe = dict(model["moe"])
        legacy.update({key: moe.pop(key) for key in _MOE_LAYOUT if key in moe})
        model["moe"] = moe
    if legacy:
        model = _layout(model, legacy)
    return {**tree, "model": model}


def _check_attention_type(kind: Any, mla: Any) -> None:
    """An old model.attention_type agrees with model.mla, as the old schema required."""
    if (kind == "mla") != (mla is not None):
        raise ConfigError(
            f"model.attention_type {kind} (now said by the presence of model.mla) but model.mla "
            f"is {'absent' if mla is None else 'set'}"
        )


def note(source: str, notes: list[str]) -> None:
    """`maxtrain: note: <source>: <notes>` on stderr, once per process; nothing without notes."""
    line = f"maxtrain: note: {source}: {'; '.join(notes)}"
    if notes and line not in _noted:
        _noted.add(line)
        print(line, file=sys.stderr, flush=True)


def replacement(key: str) -> str | None:
    """What an old key is now, for an unknown key that migration did not move (an old name
    in a section it never had): 'compute.ep_dispatch' -> 'compute.expert_exchange'."""
    if not key.startswith(("model.", "compute.")):
        return None
    leaf = key.rsplit(".", 1)[-1]
    known = {**MOVED, **LAYOUT, **DROPPED}
    return next((new for old, new in known.items() if old.rsplit(".", 1)[-1] == leaf), None)


def _old_keys(tree: dict[str, Any]) -> bool:
    model = tree.get("model")
    return any(_has(tree, key) for key in (*MOVED, *LAYOUT, *DROPPED)) or (
        isinstance(model, dict) and isinstance(model.get("qk_norm"), bool)
    )


def _dropped_unused(tree: dict[str, Any]) -> list[str]:
    """An old model's keys that were required and ignored, dropped: the key/value heads and
    head size beside multi-head latent attention, the dense width of a model whose every
    layer is MoE."""
    model = tree.get("model")
    if not isinstance(model, dict):
        return []
    unused = []
    if model.get("attention_type") == "mla":
        unused += [key for key in ("num_kv_heads", "head_dim") if model.get(key) is not None]
    moe = model.get("moe")
    if (
        isinstance(moe, dict)
        and moe.get("first_dense_layers", 0) == 0
        and moe.get("interval", 1) == 1
        and "layers" not in model
        and "mlp_dim" in model
    ):
        unused.append("mlp_dim")
    for key in unused:
        model.pop(key)
    return [f"model.{key} (unused) is dropped" for key in unused]


def _layout(model: dict[str, Any], legacy: dict[str, Any]) -> dict[str, Any]:
    """model.layers (and its sizes) from the old layout keys over the model's own layers."""
    num_layers, moe = model.get("num_layers"), model.get("moe") is not None
    if not isinstance(num_layers, int):
        raise ConfigError("config key 'model.num_layers' is required but not set")
    try:
        current = layer_types(model.get("layers"), num_layers, moe)
    except ValueError as e:
        raise ConfigError(f"config key 'model.layers' {e}") from None
    local = _local_kind(model, legacy, {t.attention for t in current})
    glob = _global_kind(model, legacy, {t.attention for t in current})
    attention = _attention(legacy, current, local, glob)
    ffn = [t.ffn for t in current]
    if "first_dense_layers" in legacy or "interval" in legacy:
        first, interval = legacy.get("first_dense_layers", 0), legacy.get("interval", 1)
        if not (isinstance(first, int) and isinstance(interval, int) and interval > 0):
            raise ConfigError(
                f"model.moe.first_dense_layers {first!r} and interval {interval!r} (now "
                "model.layers) must be integers, interval > 0"
            )
        moe_at = lambda i: moe and i >= first and (i + 1) % interval == 0  # noqa: E731
        ffn = ["moe" if moe_at(i) else "dense" for i in range(num_layers)]
    types = [LayerType(a, f) for a, f in zip(attention, ffn, strict=True)]
    model["layers"] = shortest_entries(types, moe)
    if model["layers"] is None:
        model.pop("layers")
    return model


def _attention(
    legacy: dict[str, Any], current: tuple[LayerType, ...], local: str, glob: str
) -> list[str]:
    """Per layer, its attention kind: the old pattern's, else the model's with the old
    sections' kinds for its local and global layers."""
    if "layer_pattern" not in legacy:
        renamed = {}
        if "local_attention" in legacy:
            renamed.update(sliding=local, chunked=local)
        if "global_attention" in legacy:
            renamed.update({"global": glob, "nope": glob})
        return [renamed.get(t.attention, t.attention) for t in current]
    pattern = legacy["layer_pattern"] or ["global"]
    kinds = {"global": glob, "local": local, "linear": "linear"}
    if not isinstance(pattern, list) or any(kind not in kinds for kind in pattern):
        raise ConfigError(
            f"model.layer_pattern {pattern!r} (now model.layers) must list global, local or linear"
        )
    return [kinds[pattern[i % len(pattern)]] for i in range(len(current))]


def _local_kind(model: dict[str, Any], legacy: dict[str, Any], kinds: set[str]) -> str:
    """What the old `local` layers are now, sliding or chunked; the old section's sizes moved
    to the model's keys."""
    default = "chunked" if "chunked" in kinds else "sliding"
    if "local_attention" not in legacy:
        return default
    local = legacy["local_attention"]
    if local is None:  # no local layers
        for key in ("sliding_window", "attention_chunk"):
            model.pop(key, None)
        if isinstance(model.get("rope"), dict):
            model["rope"] = {k: v for k, v in model["rope"].items() if k != "local_theta"}
        return default
    if not isinstance(local, dict):
        raise ConfigError(f"model.local_attention {local!r} must be a mapping of keys to values")
    if "rope_theta" in local:
        model["rope"] = {**(model.get("rope") or {}), "local_theta": local["rope_theta"]}
    window, chunk = local.get("window"), local.get("chunk")
    if window is not None and chunk is not None:
        raise ConfigError(
            "model.local_attention needs exactly one of window and chunk, got window "
            f"{window} and chunk {chunk}"
        )
    if window is not None:
        model.pop("attention_chunk", None)
        model["sliding_window"] = window
        return "sliding"
    if chunk is not None:
        model.pop("sliding_window", None)
        model["attention_chunk"] = chunk
        return "chunked"
    return default


def _global_kind(model: dict[str, Any], legacy: dict[str, Any], kinds: set[str]) -> str:
    """What the old `global` layers are now: global, or nope where the old section took their
    position encoding and qk-norm away; its temperature moved to model.attention_temperature."""
    default = "nope" if "nope" in kinds and "global" not in kinds else "global"
    if "global_attention" not in legacy:
        return default
    glob = legacy["global_attention"]
    if glob is None:
        model.pop("attention_temperature", None)
        return "global"
    if not isinstance(glob, dict):
        raise ConfigError(f"model.global_attention {glob!r} must be a mapping of keys to values")
    rope, qk_norm = glob.get("rope", default == "global"), glob.get("qk_norm", default == "global")
    if rope != qk_norm:
        raise ConfigError(
            f"model.global_attention with rope {rope} and qk_norm {qk_norm} has no equivalent "
            "now: a layer of model.layers is global (RoPE and qk-norm) or nope (neither)"
        )
    temperature = dict(model.get("attention_temperature") or {})
    for old, new in (("temperature_floor", "floor"), ("temperature_scale", "scale")):
        if old in glob:
            temperature[new] = glob[old]
    if temperature.get("floor") is None:  # a scale without a floor: no tuning, as before
        model.pop("attention_temperature", None)
    elif rope:
        raise ConfigError(
            "model.global_attention.temperature_floor (now model.attention_temperature) "
            "applies to nope layers only: global_attention rope false and qk_norm false"
        )
    else:
        model["attention_temperature"] = temperature
    return "global" if rope else "nope"


def _has(tree: dict[str, Any], dotted: str) -> bool:
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _pop(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    *parents, leaf = dotted.split(".")
    node: Any = tree
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, dict) or leaf not in node:
        return False, None
    return True, node.pop(leaf)


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets a dotted key unless the source sets it already in its new place (which wins)."""
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node.setdefault(leaf, value)
