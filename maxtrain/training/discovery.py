"""What `python -m maxtrain.train` tells a user before a run: its options and config sections
(--help), the model presets and their sizes (--list-models). Both are read from the schema
and the presets themselves, so they cannot fall behind them."""

from __future__ import annotations

import inspect

from pydantic import BaseModel

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.common.units import count
from maxtrain.config import Config

USAGE = (
    "python -m maxtrain.train [--debug] [--print-config] CONFIG.yml [OVERLAY.yml ...] "
    "[key=value ...]"
)

OPTIONS = {
    "--print-config": "print the resolved config (validated) as YAML, and run nothing",
    "--list-models": "list the model presets (model_name=NAME) with their sizes",
    "--debug": "tracebacks for refused inputs (as MAXTRAIN_DEBUG=1)",
    "-h, --help": "this help",
}


def help_text() -> str:
    """Usage, options, and one line per config section: its docstring's first line."""
    sections = {
        name: _first_doc_line(field.annotation)
        for name, field in Config.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    }
    return "\n".join(
        [
            f"usage: {USAGE}",
            "       python -m maxtrain.train --list-models",
            "",
            "Trains the model CONFIG.yml describes; key=value overrides any key (e.g.",
            "train.steps=50 model_name=tiny). Every key at its default: configs/reference.yml.",
            "",
            "options:",
            *(f"  {flag:<16}{text}" for flag, text in OPTIONS.items()),
            "",
            "config sections:",
            f"  {'model_name':<16}a preset (--list-models) or a model file's path",
            f"  {'base_config':<16}a parent config file, beside this one",
            *(f"  {name:<16}{text}" for name, text in sections.items()),
        ]
    )


def _first_doc_line(cls: type) -> str:
    """A section's docstring's first sentence, on one line (inherited where it has none of its
    own): a docstring's first line may stop mid-sentence."""
    paragraph = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
    return paragraph.split(". ")[0].removesuffix(".")


def models_table() -> str:
    """One line per preset: its name, parameters (total and active per token), layers and
    d_model, computed from the preset's model."""
    rows = [("model_name", "params", "active", "layers", "d_model")]
    for name in config_lib.preset_names():
        model = config_lib.preset(name)
        total, active = model_lib.param_count(model), model_lib.active_param_count(model)
        rows.append((name, count(total), count(active), str(model.num_layers), str(model.emb_dim)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )
