"""training/deepspeed_patches.py, the list of every place the project reaches into DeepSpeed, held to the installed
DeepSpeed (its version; each attribute still there, each added one still free) and to the code (every assignment into
DeepSpeed's objects and every method of a DeepSpeed subclass listed): a DeepSpeed upgrade, or a new patch, that
skips the list fails here."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from pathlib import Path

import deepspeed

from training.deepspeed_patches import CHECKED_AGAINST, KINDS, PATCHES

ROOT = Path(__file__).resolve().parent.parent
CODE = [
    p
    for d in ("training", "checkpoint", "models", "common", "tools", "data", "schema")
    for p in (ROOT / d).rglob("*.py")
]
CODE += [ROOT / "trainer.py", ROOT / "convert2ckpt.py"]
# Names the project gives DeepSpeed's objects: assignments into these are patches wherever they are; into the second
# set, in the modules that import DeepSpeed (elsewhere `module`, `p`, ... are ours or torch's).
ALWAYS = {"engine", "checkpoint_engine", "groups"}
WITH_DEEPSPEED = {"optimizer", "scheduler", "module", "p", "param"}
TORCH_OWN = {"data", "grad", "requires_grad"}  # a parameter's own fields, not flags DeepSpeed reads


def resolve(dotted: str):
    """The module, class or attribute a dotted name names."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


@functools.cache
def module_source(dotted: str) -> str:
    obj = resolve(dotted)
    return inspect.getsource(obj if inspect.ismodule(obj) else inspect.getmodule(obj))


def mentions(source: str, name: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", source) is not None


def test_the_installed_deepspeed_is_the_one_the_list_was_checked_against():
    assert deepspeed.__version__ == CHECKED_AGAINST, (
        f"DeepSpeed {deepspeed.__version__} is installed; training/deepspeed_patches.py was checked against "
        f"{CHECKED_AGAINST}: re-check every entry against the new source (its module docstring says how)"
    )


def test_each_entry_names_what_deepspeed_has_our_code_and_its_test():
    problems = []
    for patch in PATCHES:
        what = f"{patch.owner}.{patch.name} ({patch.where})"
        if patch.how not in KINDS:
            problems.append(f"{what}: kind {patch.how!r}")
        file, *function = patch.where.split()
        if not (ROOT / file).is_file():
            problems.append(f"{what}: no file {file}")
        elif function and not all(
            re.search(rf"(def|class) {re.escape(part)}\b", (ROOT / file).read_text()) for part in function[0].split(".")
        ):
            problems.append(f"{what}: no {function[0]} in {file}")
        test_file, test_name = patch.test.split("::")
        if not (ROOT / test_file).is_file() or f"def {test_name}(" not in (ROOT / test_file).read_text():
            problems.append(f"{what}: no test {patch.test}")
        owner = resolve(patch.owner)
        if patch.read_by:  # a torch object DeepSpeed holds, or a name DeepSpeed reads from ours
            if not mentions(module_source(patch.read_by), patch.name):
                problems.append(f"{what}: {patch.read_by} no longer mentions {patch.name}")
            continue
        present = hasattr(owner, patch.name) or mentions(module_source(patch.owner), f"self.{patch.name}")
        if patch.how == "added" and present:
            problems.append(f"{what}: DeepSpeed has {patch.name} now; ours would clash")
        if patch.how != "added" and not present:
            problems.append(f"{what}: DeepSpeed {deepspeed.__version__} has no {patch.name}")
    assert not problems, "\n".join(problems)


def deepspeed_imports(tree: ast.Module) -> dict[str, str]:
    """{local name: DeepSpeed dotted name} of a module's imports from DeepSpeed (at any depth)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed"):
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            names.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("deepspeed")})
    return names


def patch_sites() -> tuple[set[tuple[str, str]], set[tuple[str, str, str]]]:
    """({(file, attribute)} assigned into DeepSpeed's objects, {(file, DeepSpeed base, name)} defined by a subclass)."""
    assigned, defined = set(), set()
    for path in CODE:
        rel, tree = str(path.relative_to(ROOT)), ast.parse(path.read_text())
        imported = deepspeed_imports(tree)
        bases = ALWAYS | (WITH_DEEPSPEED | set(imported) if imported else set())  # (a DeepSpeed class by its name)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in (t for top in targets for t in ast.walk(top)):  # (a tuple's items too, stored into)
                if isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store):
                    if not isinstance(target.value, ast.Name):
                        continue
                    if target.value.id in bases and target.attr not in TORCH_OWN:
                        assigned.add((rel, target.attr))
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
                if ast.unparse(node.args[0]) in ALWAYS:
                    assigned.add((rel, "<setattr>"))
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    head, *rest = ast.unparse(base).split(".")
                    if head in imported:
                        owner = ".".join([imported[head], *rest])
                        for item in node.body:
                            name = getattr(item, "name", None) or next(
                                (t.id for t in getattr(item, "targets", []) if isinstance(t, ast.Name)), None
                            )
                            if name and name != "__doc__":
                                defined.add((rel, owner, name))
                        for store in ast.walk(node):  # `self.X = ...` in its methods: DeepSpeed's X, if it has one
                            if isinstance(store, ast.Attribute) and isinstance(store.ctx, ast.Store):
                                if isinstance(store.value, ast.Name) and store.value.id == "self":
                                    defined.add((rel, owner, f"self.{store.attr}"))
    return assigned, defined


def test_every_patch_in_the_code_is_in_the_list():
    assigned, defined = patch_sites()
    listed = {(p.where.split()[0], p.name) for p in PATCHES}
    setters = {p.where.split()[0] for p in PATCHES if p.how == "set"}
    missing = [f"{file}: .{name} = ..." for file, name in sorted(assigned) if (file, name) not in listed]
    missing = [m for m in missing if not (m.endswith(".<setattr> = ...") and m.split(":")[0] in setters)]
    for file, owner, name in sorted(defined):
        attribute = name.removeprefix("self.")
        if (file, attribute) in listed:
            continue
        if name.startswith("self.") and mentions(module_source(owner), name):
            missing.append(f"{file}: {name} = ... sets {owner}'s {attribute}")
        elif not name.startswith("self.") and hasattr(resolve(owner), name):
            missing.append(f"{file}: {name} overrides {owner}.{name}")
    assert not missing, "not in training/deepspeed_patches.py:\n" + "\n".join(missing)
    assert len(PATCHES) >= 60 and len(assigned) >= 25  # the scan still sees the sites (31 on 2026-12-07)
