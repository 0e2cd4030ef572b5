"""The code's shape stays true: imports only run downward, no cycles, small files, model maths without DeepSpeed.

Layers, bottom to top (a package may import only from layers below it, or itself):

    schema <- common, models <- checkpoint, data <- training <- trainer.py, convert2ckpt.py, tools/ <- demo/,
    benchmarks/ <- tests/
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO, subprocess_env

LAYERS = {
    "schema": 0,
    "common": 1,
    "models": 1,
    "checkpoint": 2,
    "data": 2,
    "training": 3,
    "trainer": 4,
    "convert2ckpt": 4,
    "tools": 4,
    "demo": 5,
    "benchmarks": 5,
    "tests": 6,
}
# Entry points that live inside a package because their command names it (none since `python -m data.prepare`
# composes the config from schema/, below data/): a module here sits on the given layer, not its package's.
ENTRY_POINTS: dict[str, int] = {}
# Lines per file as `ruff format` writes them (no `# fmt: skip` packing): 400 is the budget of library modules;
# test modules hold tables of cases and get 500 before they are split by theme.
MAX_LINES = 400
MAX_TEST_LINES = 500


def python_files() -> list[Path]:
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("outputs", "runs", "__pycache__")]
        files += [Path(root) / n for n in names if n.endswith(".py")]
    return files


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> repository modules it imports (anywhere in the file, function-level imports included)."""
    modules = {module_name(p): p for p in python_files()}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def package(module: str) -> str:
    return module if module in ENTRY_POINTS else module.split(".")[0]


def test_imports_only_run_downward():
    upward = []
    for module, targets in import_graph().items():
        for target in targets:
            a, b = package(module), package(target)
            if a != b and {**LAYERS, **ENTRY_POINTS}[b] >= {**LAYERS, **ENTRY_POINTS}[a]:
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_no_file_over_its_line_budget():
    def budget(path: Path) -> int:
        return MAX_TEST_LINES if path.relative_to(REPO).parts[0] == "tests" else MAX_LINES

    long = {str(p.relative_to(REPO)): n for p in python_files() if (n := len(p.read_text().splitlines())) > budget(p)}
    assert not long, long


def test_model_maths_and_data_import_without_deepspeed():
    """Partitioning, the loss, the layout table and the data pipeline need no DeepSpeed (nor a process group)."""
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import models.partition, models.loss, models.key_table, data.collator, data.dataset, data.sampling\n"
        "from tools.tiny_models import tiny_config\n"
        "print(models.partition.stage_bounds(tiny_config(num_hidden_layers=10), 4, [2, 3, 3, 2]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[0, 3, 6, 9, 13]"


def test_model_code_knows_nothing_of_distribution():
    """Inside models/, only the wiring (pipeline.py: DeepSpeed; tensor_parallel.py, tp_collectives.py,
    vocab_parallel_loss.py and sequence_parallel.py: TP collectives; expert_parallel.py: the experts' all-to-all;
    context_parallel.py: DeepSpeed's Ulysses attention)
    imports torch.distributed or DeepSpeed; layers, layout, sharding, loss, partition, LoRA, preference losses,
    experts' keys and config do not."""
    wiring = {
        "models.pipeline",
        "models.tensor_parallel",
        "models.tp_collectives",
        "models.vocab_parallel_loss",
        "models.sequence_parallel",
        "models.expert_parallel",
        "models.context_parallel",
    }
    offenders = []
    for path in python_files():
        name = module_name(path)
        if not name.startswith("models.") or name in wiring:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{name}: {n}" for n in names if n.startswith(("torch.distributed", "deepspeed"))]
    assert not offenders, offenders


def _code_words(tree: ast.AST):
    """(line, word) of every identifier and string literal of a module that is not a docstring."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg


def test_no_family_is_named_outside_the_registry():
    """Generic code names no family: a family's model type, container type or transformers class prefix appears
    in code only in its own module of models/families/ (tests, benchmarks of one family's block, docstrings and
    comments aside; tokenizer classes are not model families)."""
    import re

    from models.families import CONTAINERS, FAMILIES

    types = sorted([*FAMILIES, *CONTAINERS], key=len, reverse=True)
    prefixes = sorted({f.prefix for f in FAMILIES.values()}, key=len, reverse=True)
    named = re.compile(
        r"(?<![A-Za-z0-9])(" + "|".join(types) + r")(?![a-z0-9])|(" + "|".join(prefixes) + r")(?=[A-Z])(?!\w*Tokenizer)"
    )
    exempt = ("tests", "benchmarks", os.path.join("models", "families"))
    offenders = []
    for path in python_files():
        relative = str(path.relative_to(REPO))
        if relative.startswith(exempt):
            continue
        for line, word in _code_words(ast.parse(path.read_text())):
            if named.search(word):
                offenders.append(f"{relative}:{line}: {word[:80]!r}")
    assert not offenders, offenders
