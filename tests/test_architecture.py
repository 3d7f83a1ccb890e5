"""The tree matches docs/architecture.md: only entry points at the package root, imports that
point downward (none from model code into training, post-training, inference, evaluation or
the run's config; no cycle, imports inside functions included), and every repository path
the docs, docstrings and comments name exists. Read from the source (AST), nothing imported."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
from support import REPO

PACKAGE = REPO / "maxtrain"
ENTRY_POINTS = {"__init__.py", "train.py", "generate.py", "evaluate.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The maxtrain modules a file imports, anywhere in it (functions included): `from a.b
    import c` counts a.b.c when c is a module, else a.b (a package's own re-exports from its
    submodules are how a package presents itself, not a cycle)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [f"{node.module}.{a.name}" for a in node.names]
            names = [m for m in modules if m in MODULES]
            if len(names) < len(modules):  # names defined in node.module itself
                names.append(node.module)
        for name in names:
            if name.split(".")[0] != "maxtrain":
                continue
            found.add(name)
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def test_the_package_root_holds_only_entry_points():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    assert modules <= ENTRY_POINTS, sorted(modules - ENTRY_POINTS)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_lazy_imports_included():
    assert _cycles() == []


FORBIDDEN_FOR_MODEL = (
    "maxtrain.training",
    "maxtrain.posttrain",
    "maxtrain.inference",
    "maxtrain.evaluation",
    "maxtrain.benchmarks",
    "maxtrain.planning",
)
MODEL_PACKAGES = ["maxtrain.kernels", "maxtrain.layers", "maxtrain.models", "maxtrain.parallel"]


@pytest.mark.parametrize("package", MODEL_PACKAGES)
def test_model_code_imports_downward_only(package):
    wrong = {
        module: sorted(i for i in imports if i.startswith(FORBIDDEN_FOR_MODEL))
        for module, imports in GRAPH.items()
        if module.startswith(package)
    }
    assert {m: i for m, i in wrong.items() if i} == {}


def _reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for imported in GRAPH[todo.pop()] - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


# What each of the model's packages may not reach through any chain of imports (parallel/
# included): kernels know no layer, layers know no model.
ABOVE = {
    "maxtrain.kernels": ("maxtrain.layers", "maxtrain.models"),
    "maxtrain.layers": ("maxtrain.models",),
}


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_kernels_then_layers_then_models(package):
    upward = {
        module: sorted(m for m in _reachable(module) if m.startswith(ABOVE[package]))
        for module in GRAPH
        if module.startswith(package)
    }
    assert {m: u for m, u in upward.items() if u} == {}


@pytest.mark.parametrize("package", ["kernels", "layers", "models", "parallel"])
def test_model_code_takes_its_own_config_not_the_runs(package):
    """Layers, kernels and parallel building blocks take ModelConfig, MeshConfig, ...: never
    the run's whole Config (training/run_model.py composes the run's model from them)."""
    takers = [
        str(path.relative_to(REPO))
        for path in (PACKAGE / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("maxtrain.config")
        and any(alias.name == "Config" for alias in node.names)
    ]
    assert takers == []


TOOLS = sorted((REPO / "tools").glob("*.py"))
# The generators of committed files (fixtures, data assets) are whole programs; every other
# tool is a script over the package: its work, and what tests call, is a maxtrain module.
GENERATORS = {p for p in TOOLS if p.name.startswith("make_")}


def _all_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _edits_sys_path(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == "path" and getattr(n.value, "id", "") == "sys"
        for n in ast.walk(tree)
    )


@pytest.mark.parametrize("tool", [p.name for p in TOOLS])
def test_tools_are_scripts_over_the_installed_package(tool):
    """No sys.path edits, no package named tools, maxtrain modules that exist; a tool that is
    not a generator runs one package module's main and holds nothing else."""
    path = REPO / "tools" / tool
    tree = ast.parse(path.read_text())
    assert not (REPO / "tools" / "__init__.py").exists()
    assert not _edits_sys_path(tree)
    ours = {m for m in _all_imports(path) if m.split(".")[0] == "maxtrain"}
    assert {m for m in ours if m not in MODULES} == set()
    if path not in GENERATORS:
        body = [n for n in tree.body if not isinstance(n, ast.Expr | ast.Import | ast.ImportFrom)]
        assert len(body) <= 2 and len(ours) == 1, f"{tool}: more than a call of one main"


# Runs each guide's `python tools/<name>.py ...` as that command does (the script as __main__, its
# sys.argv set), in this process rather than a subprocess for the test budget.
RUNS_TOOLS_AS_COMMANDS = REPO / "tests" / "test_docs_commands.py"


def test_nothing_imports_the_tools():
    """Tests call the package module behind a tool, never the script (a script run in a
    subprocess, as a user runs it, is not an import)."""
    importers = sorted(
        str(path.relative_to(REPO))
        for path in [*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("*.py"), *TOOLS]
        if path not in (Path(__file__), RUNS_TOOLS_AS_COMMANDS)
        if any(m == "tools" or m.startswith("tools.") for m in _all_imports(path))
        or {"run_path", "spec_from_file_location"} & _code_words(ast.parse(path.read_text()))
    )
    assert importers == []


# Names that say "lora" without being LoRA's business: Qwix's names for an adapter's two
# parameters, flax's variable type for them, and DeepSeek's low-rank MLA projections.
_NOT_LORA = re.compile(r"kernel_lora_[ab]|LoRAParam|q_lora_rank|kv_lora_rank|_MLA_Q_LORA")
# Where LoRA lives: its package, its config section, and the tools' CLIs of each subsystem.
LORA_HOMES = ("maxtrain/posttrain/", "maxtrain/config/", "maxtrain/benchmarks/")


def _code_words(tree: ast.AST) -> set[str]:
    """Every identifier, attribute, imported name and string in a module's code (comments and
    docstrings are prose, not wiring)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.alias):
            words.add(node.name)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.arg):
            words.add(getattr(node, "name", None) or node.arg)
        elif isinstance(node, ast.ImportFrom) and node.module:
            words.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                words.add(node.value)
    return words


def test_tests_mirror_the_packages():
    """tests/<package>/ holds the tests of maxtrain/<package>/ (tests/support/ what several
    share, tests/fixtures/ committed oracle outputs); only the project-wide tests sit at the
    root: this one, the guides' commands, and the Dockerfile's."""
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and p.name[0] not in "._"}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders - {"support", "fixtures"} <= packages
    at_root = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert at_root == ["test_architecture.py", "test_dockerfile.py", "test_docs_commands.py"]


def test_lora_is_wired_only_through_post_training():
    """The loop, the step, the state, the model and the tools around them know a parameter
    split (training/split.py), never LoRA: its code lives in maxtrain/posttrain/, picked in
    one place (maxtrain/posttrain/__init__.py)."""
    wired = {
        str(path.relative_to(REPO)): sorted(w for w in words if "lora" in w.lower())
        for path in MODULES.values()
        if not str(path.relative_to(REPO)).startswith(LORA_HOMES)
        for words in [{_NOT_LORA.sub("", w) for w in _code_words(ast.parse(path.read_text()))}]
    }
    assert {path: words for path, words in wired.items() if words} == {}


_PATH = re.compile(
    r"(?<![\w/.-])((?:maxtrain|tests|configs|recipes|docs|tools|\.ci)/[\w./*-]*[\w/*])"
)
# The package's prose names its own files package-relative: `layers/moe.py` is
# maxtrain/layers/moe.py. Only .py files, so that parameter paths (layers/mlp/down) are not read
# as files. A path written after its repository (MaxText/benchmarks/x.py) is another project's.
_SUBPACKAGES = "|".join(sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
_PACKAGE_PATH = re.compile(rf"(?<![\w/.-])((?:{_SUBPACKAGES})/[\w/-]*\w\.py)\b")


def _exists(path: str) -> bool:
    """A file or folder, or the prefix of files named by it (data/web for data/web.bin and
    data/web.idx, a test module named without .py)."""
    found = REPO / path
    return found.exists() or any(found.parent.glob(f"{found.name}.*"))


def _missing_paths(text: str) -> list[str]:
    named = {m.rstrip("/.") for m in _PATH.findall(text) if "*" not in m}
    named |= {f"maxtrain/{m}" for m in _PACKAGE_PATH.findall(text)}
    return sorted(p for p in named if not _exists(p))


@pytest.mark.parametrize(
    "doc",
    sorted(
        str(p.relative_to(REPO))
        for p in [
            REPO / "README.md",
            *(REPO / "docs").glob("*.md"),
            *(REPO / "recipes").rglob("*.md"),
        ]
    ),
)
def test_every_path_the_docs_name_exists(doc):
    assert _missing_paths((REPO / doc).read_text()) == []


def _prose(path: Path) -> str:
    """A module's comments and docstrings: where a pointer to another file goes stale unseen."""
    source = path.read_text()
    tree = ast.parse(source)
    docstrings = [
        ast.get_docstring(node, clean=False) or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
    return "\n".join(docstrings + comments)


@pytest.mark.parametrize("folder", ["maxtrain", "tools", "tests"])
def test_every_path_the_code_comments_name_exists(folder):
    missing = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / folder).rglob("*.py"))
        if (found := _missing_paths(_prose(path)))
    }
    assert missing == {}


def test_the_tree_in_docs_architecture_is_the_packages():
    """docs/architecture.md's tree names every package under maxtrain/, and only those."""
    text = (REPO / "docs" / "architecture.md").read_text()
    tree = text.split("```")[1]
    named = set(re.findall(r"^  (\w+)/", tree, re.MULTILINE))
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert named == packages


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def test_modules_and_functions_fit_on_a_screen_or_a_few():
    """No module in maxtrain/ over 500 lines, no function over 60 (its def line to its last):
    a reader holds one job at a time."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(REPO))
        source = path.read_text()
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        too_long += [
            f"{name}:{node.lineno} {node.name}: {length} lines"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
        ]
    assert too_long == []
