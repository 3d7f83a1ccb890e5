"""Every command the guides show runs as written: README.md, docs/*.md and recipes/*/README.md,
each code line calling `python -m maxtrain.X` or `python tools/<name>.py`.

A command runs in this process (8 simulated CPU devices, where a reader's CPU has one), in a
scratch directory per guide that sees the checkout's configs, recipes, package data and test
fixtures (so that nothing is written into the checkout), in the dry or tiny form the test
budget allows:

- `maxtrain.train` gets `--print-config` (the config and its overrides resolved and
  validated), unless it is one of the flags that run nothing anyway;
- `tools/benchmark.py --dry-run` without `--compile` runs whole (an estimate, no compile);
- `tools/convert_hf.py import` of a committed fixture runs whole (a user's own model
  directory stands for the fixture of its family, so that the commands after it in the same
  guide find what it wrote);
- everything else (training, generation from a trained run, a TPU compile, MaxText) is parsed
  by its own argument parser, and a config it names is loaded with its overrides.

A command the guide shows refused (`maxtrain: error: ...` on the line after it) must exit 2
with that line. Placeholders a guide writes for the reader (CONFIG.yml, [key=value ...], ...)
are filled in by PLACEHOLDERS. `-rP` prints every command with its exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import REPO

from maxtrain import config as config_lib
from maxtrain import evaluate, generate
from maxtrain.common.errors import ArgumentParser
from maxtrain.training import loop

GUIDES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GUIDES += sorted((REPO / "recipes").glob("*/README.md"))
COMMAND = re.compile(r"(?:\.venv/bin/)?python (-m maxtrain\.\w+|tools/\w+\.py)\b")

# What a guide writes for the reader to fill in -> what the test fills in.
PLACEHOLDERS = {
    "CONFIG.yml plan.yml": "configs/base.yml configs/plans/dense-1.5b-v5e-4x4.yml",
    "CONFIG.yml": "configs/base.yml",
    "[OVERLAY.yml ...] ": "",
    "[dotted.key=value ...]": "",
    "[key=value ...]": "",
    "h100/<recipe>": "h100/dense-1.5b",
    "<recipe>": "llama3-8b",
    "[LAYOUT]": "",
    "[SCHEDULE]": "",
    "kernel|plain": "kernel",
    "[--unrolled]": "--unrolled",
    "[model.moe.n_group=8 model.moe.topk_group=2]": "model.moe.n_group=8 model.moe.topk_group=2",
    "[--maxtext-option float32_qk_product=true --maxtext-option float32_logits=true]": (
        "--maxtext-option float32_qk_product=true --maxtext-option float32_logits=true"
    ),
    "checkpoint.load_parameters_path=... ": "checkpoint.load_parameters_path=runs/x ",
    "runs/lora-merged ...": "runs/lora-merged",
    "RUN_DIR": "runs/default",
    "RUN.yml": "configs/base.yml",
    "CONFIG key=value      (train.py -> training/loop.py main)": "configs/base.yml",
    "~/models/Llama-3.2-1B": "tests/fixtures/hf/llama_gqa_untied_sharded",
    "PATH/TO/Qwen3-Next": "tests/fixtures/hf/qwen3_next_hybrid_moe_v5",
    "PATH/TO/HF/MODEL": "tests/fixtures/hf/gemma3_window4_linear_rope_v5",
    "/tmp/b.npz": "b.npz",
}
# Read-only inputs the commands name, relative to the checkout.
INPUTS = ["configs", "recipes", "maxtrain", "tests"]


@dataclass(frozen=True)
class Command:
    where: str  # guide:line
    argv: list[str]  # after `python`: ["-m", "maxtrain.train", ...] or ["tools/<name>.py", ...]
    refusal: str | None  # the error line the guide shows after it, if any


def documented_commands() -> list[Command]:
    commands = []
    for guide in GUIDES:
        lines = guide.read_text().splitlines()
        fenced = False
        for i, line in enumerate(lines):
            if line.strip().startswith("```"):
                fenced = not fenced
                continue
            if not (fenced or line.startswith("    ")) or not (found := COMMAND.search(line)):
                continue
            text, j = line[found.start() :], i
            while text.rstrip().endswith("\\") and j + 1 < len(lines):
                j += 1
                text = text.rstrip()[:-1] + " " + lines[j].strip()
            if "<name>" in text:  # a tree's description of tools/, not a command
                continue
            after = lines[j + 1].strip() if j + 1 < len(lines) else ""
            refusal = after if re.match(r"^[\w.]+: error: ", after) else None
            where = f"{guide.relative_to(REPO)}:{i + 1}"
            commands.append(Command(where, _argv(text), refusal))
    return commands


def _argv(text: str) -> list[str]:
    """A shell line as its arguments: placeholders filled, a trailing comment, a closing quote
    of an outer command (ssh --command "...") and a leading `python` dropped."""
    for written, filled in PLACEHOLDERS.items():
        text = text.replace(written, filled)
    text = text.rstrip()
    if text.count('"') % 2:  # the end of an outer command's quoted argument
        text = text.removesuffix('"')
    # bash's $'...' (escapes in a quoted word), which shlex does not read
    ansi_c = lambda m: shlex.quote(m[1].encode().decode("unicode_escape"))  # noqa: E731
    text = re.sub(r"\$'((?:[^'\\]|\\.)*)'", ansi_c, text)
    words = shlex.split(text, comments=True)
    return words[1:]


def _program(argv: list[str]):
    """(the command's main, its arguments): an entry point's main, or a tool script run as
    `python tools/<name>.py` runs it (its __main__ block, sys.argv set), returning its exit
    status."""
    if argv[0] == "-m":
        mains = {"maxtrain.train": loop.main, "maxtrain.generate": generate.main}
        return {**mains, "maxtrain.evaluate": evaluate.main}[argv[1]], argv[2:]

    def script(args: list[str]) -> int:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "argv", [argv[0], *args])
            try:
                runpy.run_path(str(REPO / argv[0]), run_name="__main__")
            except SystemExit as e:
                return e.code or 0
        return 0

    return script, argv[1:]


class Parsed(Exception):
    """Raised by the parsers once they have parsed: the command is valid as far as that."""

    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


@contextlib.contextmanager
def parse_only():
    """Every argument parser stops the command as soon as it has parsed its arguments."""
    with pytest.MonkeyPatch.context() as patch:
        for cls in (argparse.ArgumentParser, ArgumentParser):
            original = cls.parse_args

            def parse_args(self, args=None, namespace=None, _original=original):
                raise Parsed(_original(self, args, namespace))

            patch.setattr(cls, "parse_args", parse_args)
        yield


def _runs_whole(argv: list[str]) -> bool:
    tool = argv[0]
    if tool == "tools/benchmark.py":
        return "--dry-run" in argv and "--compile" not in argv
    if tool == "tools/convert_hf.py":
        return argv[1] == "import" and "tests/fixtures/" in " ".join(argv)
    return False


def run(command: Command, capsys) -> tuple[int, str, str]:
    """(exit status, how it ran, stderr) of the command in its dry or tiny form."""
    argv = command.argv
    main, args = _program(argv)
    if argv[:2] == ["-m", "maxtrain.train"]:
        runs_nothing = {"--help", "--list-models", "--print-config"} & set(args)
        form = "as written" if runs_nothing else "--print-config"
        status = main(args if runs_nothing else ["--print-config", *args])
    elif _runs_whole(argv):
        form, status = "as written", main(args)
    else:
        form = "parsed"
        with parse_only():
            try:
                status = main(args)
            except Parsed as parsed:
                status, settings = 0, vars(parsed.namespace)
            except SystemExit as e:
                status, settings = e.code, {}
        config = settings.get("config")
        if isinstance(config, str) and config.startswith(("configs/", "recipes/")):
            config_lib.load(config, settings.get("overrides") or [])  # not a run's own config
            form = "parsed, config validated"
    return status, form, capsys.readouterr().err


COMMANDS = documented_commands()


def scratch(root: Path, guide: str) -> Path:
    """The directory a guide's commands run in: its own, as a reader follows one guide."""
    directory = root / guide.replace("/", "-")
    if not directory.exists():
        directory.mkdir()
        for name in INPUTS:
            (directory / name).symlink_to(REPO / name)
    return directory


def test_the_guides_show_commands():
    """The extraction finds the guides' commands (a change of their markup would hide them)."""
    assert len(COMMANDS) > 90
    assert {c.argv[0] if c.argv[0] != "-m" else c.argv[1] for c in COMMANDS} >= {
        "maxtrain.train", "maxtrain.generate", "maxtrain.evaluate", "tools/benchmark.py",
        "tools/convert_hf.py", "tools/show_data.py", "tools/compare_maxtext.py",
    }  # fmt: skip
    assert sum(c.refusal is not None for c in COMMANDS) == 2  # README's two refusals


def test_every_documented_command_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MAXTRAIN_DEBUG", raising=False)
    failed, table = [], []
    for command in COMMANDS:
        monkeypatch.chdir(scratch(tmp_path, command.where.split(":")[0]))
        status, form, err = run(command, capsys)
        expected = 2 if command.refusal else 0
        table.append(f"{status}  {command.where}  ({form})  python {shlex.join(command.argv)}")
        if status != expected or (command.refusal and err.strip() != command.refusal):
            failed.append(f"{command.where}: exit {status} ({form}): {err.strip()[-300:]}")
    print("\n".join(table))  # the exit status of each (pytest -rP)
    assert not failed, "\n".join(failed)
