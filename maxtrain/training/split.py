"""Which parameters a run trains and which it holds frozen: the one interface through which
post-training changes the model, the state, the step and the checkpoints.

The train state keeps two parts (training/state.py): `params`, which the optimizer updates and
checkpoints save, and `frozen`, which the step reads but never changes and no checkpoint holds:
it is read from checkpoint.load_parameters_path at every start and resume. A split says how
the model's parameters divide into the two and how the model runs on them. Pre-training has
nothing frozen (`WholeModel`); the others live in maxtrain/posttrain/ (LoRA's adapters on a
frozen base, DPO's frozen reference copy) and are picked once, by posttrain's `parameter_split`.
"""

from __future__ import annotations

from typing import Any, Protocol

from flax import nnx

from maxtrain.config import Config


class ParameterSplit(Protocol):
    """How a run's parameters divide into trained and frozen."""

    # Adds parameters the base model lacks (adapters): the model is built through `adapt` and
    # run through `wrap`, and the added parameters compute in the model's compute dtype.
    adds_parameters: bool
    # checkpoint.load_parameters_path initialises the trained part (else only the frozen one)
    loads_trained: bool
    # there is a frozen part, read from checkpoint.load_parameters_path at every (re)start
    has_frozen: bool

    def adapt(self, module: nnx.Module, seed: int) -> None:
        """Adds the trained parameters the base model has not, after it is initialised (so
        that the base initialises the same with and without them)."""

    def wrap(self, module: nnx.Module) -> nnx.Module:
        """The module that runs them (may be abstract: nothing is created)."""

    def split(self, params: dict) -> tuple[dict, Any]:
        """The model's parameters (or a tree shaped like them) -> (trained, frozen or None)."""

    def combine(self, trained: Any, frozen: Any) -> Any:
        """The parameters the model runs on."""

    def stored(self, frozen: Any, abstract_state: nnx.State) -> Any:
        """The frozen part as the state keeps it (quantized, for QLoRA)."""

    def start(self, trained: Any, frozen: Any) -> Any:
        """The model the run started from, as parameters the model runs on: the reference an
        objective compares with (DPO). None where the split cannot tell it."""

    def describe(self, cfg: Config) -> str:
        """What trains, for the start-up line ("" when the whole model does)."""


class WholeModel:
    """Every parameter trains; nothing is frozen (pre-training, SFT)."""

    adds_parameters = False
    loads_trained = True
    has_frozen = False

    def adapt(self, module: nnx.Module, seed: int) -> None:
        del module, seed

    def wrap(self, module: nnx.Module) -> nnx.Module:
        return module

    def split(self, params: dict) -> tuple[dict, Any]:
        return params, None

    def combine(self, trained: Any, frozen: Any) -> Any:
        del frozen
        return trained

    def stored(self, frozen: Any, abstract_state: nnx.State) -> Any:
        del abstract_state
        return frozen

    def start(self, trained: Any, frozen: Any) -> Any:
        del trained, frozen
        return None

    def describe(self, cfg: Config) -> str:
        del cfg
        return ""
