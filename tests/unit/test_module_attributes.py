"""Every ``module.name`` the package's code reads from one of its own modules names something
that module defines, read from the source. Code that runs only on a GPU (hvd_trainer/cuda) or
under one framework never runs in most test environments, so a rename that misses it shows
first on a user's machine: the GPU check found ``ops._check_array`` called in
cuda/compression.py two renames after it was gone."""
import ast
import functools
import os
from typing import Dict, FrozenSet, List, Set

import pytest

pytestmark = pytest.mark.tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = {"hvd_trainer": "hvd_trainer", "hvd_trainer_launch": "launch"}


def _modules() -> Dict[str, str]:
    """Module name -> file, for every module of the package and of the launcher."""
    found = {}
    for package, folder in PACKAGES.items():
        root = os.path.join(REPO, folder)
        for here, _, files in os.walk(root):
            for f in files:
                if f.endswith(".py"):
                    parts = [package, *os.path.relpath(os.path.join(here, f), root)[:-3]
                             .split(os.sep)]
                    if parts[-1] == "__init__":
                        parts.pop()
                    found[".".join(parts)] = os.path.join(here, f)
    return found


MODULES = _modules()
TREES = {name: ast.parse(open(path).read(), path) for name, path in MODULES.items()}


# Scripts that read the package's modules too, and run only on a GPU machine.
SCRIPTS = [os.path.join(REPO, "benchmarks", "gpu.py"),
           *(os.path.join(here, f) for here, _, files in os.walk(os.path.join(REPO, "tests", "gpu"))
             for f in files if f.endswith(".py"))]


def _absolute(name: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in module ``name`` names, levels resolved."""
    if not node.level:
        return node.module or ""
    package = name if MODULES[name].endswith("__init__.py") else name.rpartition(".")[0]
    base = package.split(".")
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def defined(name: str) -> FrozenSet[str]:
    """The names a module binds outside its functions and classes (in ``if`` and ``try``
    blocks too), its functions' ``global`` names, and its subpackages."""
    out: Set[str] = set()
    pending = list(TREES[name].body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            out.update(n for inner in ast.walk(node) if isinstance(inner, ast.Global)
                       for n in inner.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        else:  # the statement's own targets, then the statements it holds
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    pending.append(child)
                else:
                    out.update(target.id for target in ast.walk(child)
                               if isinstance(target, ast.Name)
                               and isinstance(target.ctx, ast.Store))
    # A package's submodules are its attributes once imported.
    prefix = name + "."
    out.update(m[len(prefix):].split(".")[0] for m in MODULES if m.startswith(prefix))
    return frozenset(out)


def module_aliases(name: str, tree: ast.Module) -> Dict[str, str]:
    """Local names that stand for one of our modules in ``tree`` (module ``name``, or a script
    where ``name`` is None): ``from . import ops``, ``from ..collectives import ops as
    collective_ops``, ``import hvd_trainer.x as y``."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(name, node) if name else node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    aliases[alias.asname] = alias.name
    return aliases


def unknown_attributes(name: str, tree: ast.Module, path: str) -> List[str]:
    """``alias.attr`` reads in ``tree`` whose module defines no ``attr``."""
    aliases = module_aliases(name, tree)
    missing = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            target = aliases[node.value.id]
            if node.attr not in defined(target):
                missing.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr} "
                               f"({target} defines no {node.attr})")
    return missing


def test_every_module_attribute_read_is_defined():
    missing = [line for name in sorted(MODULES)
               for line in unknown_attributes(name, TREES[name], MODULES[name])]
    assert not missing, "\n".join(missing)


def test_the_gpu_scripts_read_only_defined_module_attributes():
    missing = [line for path in SCRIPTS
               for line in unknown_attributes(None, ast.parse(open(path).read(), path), path)]
    assert not missing, "\n".join(missing)


def test_the_check_finds_a_name_a_module_lost():
    # The GPU check's find, as it was: cuda/compression.py read ops._check_array.
    source = "from . import ops\nops._check_array(1, 'x')\nops.DEVICE.check(1, 'x')\n"
    path = os.path.join(REPO, "hvd_trainer", "cuda", "probe.py")
    MODULES["hvd_trainer.cuda.probe"] = path
    try:
        found = unknown_attributes("hvd_trainer.cuda.probe", ast.parse(source), path)
    finally:
        del MODULES["hvd_trainer.cuda.probe"]
    assert len(found) == 1 and "ops._check_array" in found[0]
