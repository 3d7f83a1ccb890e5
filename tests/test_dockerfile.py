"""The Dockerfile builds as far as the repository can tell without docker: every `COPY` source
exists, every extra a target installs is declared in pyproject.toml, the entry point is a module
of the package, and the CPU target holds what CI tests. A `COPY` of a folder that moved away
(`COPY tools ./tools` while there was no tools/) stops every `docker build`; this test fails
first. Read from the text, nothing built."""

import ast
import re
import shlex
import tomllib

from support import REPO

DOCKERFILE = REPO / "Dockerfile"
# What CI tests (.ci/run runs README's test command in the checkout): the package, the configs
# and recipes it reads relative to itself, and the tools the guides run.
WHAT_CI_TESTS = {"pyproject.toml", "maxtrain", "configs", "recipes", "tools"}


def _instructions() -> list[tuple[str, str, str]]:
    """(stage, instruction, arguments) for each instruction, continuation lines joined and
    comments dropped; the stage is the name after `FROM ... AS`."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stage, out = "", []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            words = arguments.split()
            stage = words[2] if len(words) == 3 and words[1].upper() == "AS" else words[0]
        out.append((stage, instruction, arguments.strip()))
    return out


def _parents() -> dict[str, str]:
    """Each stage's base image, which is another stage's name when it builds on it."""
    return {s: a.split()[0] for s, i, a in _instructions() if i == "FROM"}


def _stage_chain(stage: str) -> list[str]:
    parents, chain = _parents(), [stage]
    while parents.get(chain[-1]) in parents:
        chain.append(parents[chain[-1]])
    return chain


def _copy_sources(stages: list[str] | None = None) -> list[str]:
    sources = []
    for stage, instruction, arguments in _instructions():
        if instruction not in ("COPY", "ADD") or (stages and stage not in stages):
            continue
        if arguments.startswith("["):
            words = ast.literal_eval(arguments)
        else:
            words = [w for w in shlex.split(arguments) if not w.startswith("--")]
        sources += words[:-1]
    return sources


def _extras(stages: list[str] | None = None) -> set[str]:
    """The extras of every `pip install ".[a,b]"` (quoted or not) in the given stages."""
    found = set()
    for stage, instruction, arguments in _instructions():
        if instruction == "RUN" and (not stages or stage in stages):
            for group in re.findall(r"\.\[([\w,\s-]+)\]", arguments):
                found |= {e.strip() for e in group.split(",")}
    return found


def _exec_form(instruction: str) -> list[str]:
    [arguments] = [a for _, i, a in _instructions() if i == instruction]
    return ast.literal_eval(arguments)


def test_every_copy_source_exists():
    sources = _copy_sources()
    assert sources, "the Dockerfile copies nothing"
    assert sorted(s for s in sources if not (REPO / s).exists()) == []


def test_every_extra_installed_is_declared_in_pyproject():
    with open(REPO / "pyproject.toml", "rb") as f:
        declared = set(tomllib.load(f)["project"]["optional-dependencies"])
    installed = _extras()
    assert installed, "no target installs an extra (the accelerator builds do)"
    assert sorted(installed - declared) == []


def test_the_entry_point_is_a_module_and_its_default_config_exists():
    entry = _exec_form("ENTRYPOINT")
    assert entry[:2] == ["python", "-m"], entry
    module = REPO.joinpath(*entry[2].split("."))
    assert module.with_suffix(".py").is_file() or (module / "__main__.py").is_file(), entry[2]
    config = _exec_form("CMD")[0]
    assert (REPO / config).is_file(), config


def test_the_cpu_target_holds_what_ci_tests():
    """CI runs the suite on CPU jax in the checkout: the CPU image copies the same parts and
    installs the project's own dependencies, no accelerator extra."""
    chain = _stage_chain("cpu")
    copied = {s.rstrip("/") for s in _copy_sources(chain)}
    assert sorted(WHAT_CI_TESTS - copied) == []
    assert _extras(chain) == set()
    assert any(i == "RUN" and "pip install -e ." in a for s, i, a in _instructions() if s in chain)
