"""The public faces, read from the source (no framework is imported): each declares
``__all__``, every name in it is bound there and documented in the API reference, nothing else
(``require``, ``PYTORCH``, ``tf``, ``Any``) is public; and every cross-reference in the
package's docstrings (``:func:`...```, ``:class:`...```, ...) names something that exists."""
import ast
import functools
import importlib.util
import os
import re
from typing import Dict, List, Optional, Tuple

import pytest

# The same in every environment: CI checks it in its first pass only.
pytestmark = pytest.mark.tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.join(REPO, "hvd_trainer")


def _modules() -> Dict[str, str]:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                name = os.path.relpath(os.path.join(folder, f), REPO)[:-3].replace(os.sep, ".")
                found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = \
                    os.path.join(folder, f)
    return found


MODULES = _modules()
TREES = {name: ast.parse(open(path).read()) for name, path in MODULES.items()}

# Each face, and the API reference page that documents it. The adapters' faces, and the
# submodules of theirs that hvdrun --horovod's shim re-exports as Horovod's modules.
FACES = {
    "hvd_trainer": "api/hvd_trainer.md",
    "hvd_trainer.compression": "api/hvd_trainer.md",
    "hvd_trainer.elastic": "api/hvd_trainer.md",
    "hvd_trainer.training.hooks": "api/hvd_trainer.md",
    "hvd_trainer.torch": "api/torch.md",
    "hvd_trainer.torch.compression": "api/torch.md",
    "hvd_trainer.torch.sync_batch_norm": "api/torch.md",
    "hvd_trainer.torch.elastic": "api/torch.md",
    "hvd_trainer.mxnet": "api/mxnet.md",
    "hvd_trainer.mxnet.elastic": "api/mxnet.md",
    "hvd_trainer.tensorflow": "api/tensorflow.md",
    "hvd_trainer.tensorflow.compression": "api/tensorflow.md",
    "hvd_trainer.tensorflow.sync_batch_norm": "api/tensorflow.md",
    "hvd_trainer.tensorflow.elastic": "api/tensorflow.md",
    "hvd_trainer.tensorflow.keras": "api/keras.md",
    "hvd_trainer.tensorflow.keras.callbacks": "api/keras.md",
    "hvd_trainer.tensorflow.keras.elastic": "api/keras.md",
    "hvd_trainer.keras": "api/keras.md",
    "hvd_trainer.spark": "spark.md",
    "hvd_trainer.ray": "ray.md",
}
# A face documented under another name: hvd_trainer.keras is hvd_trainer.tensorflow.keras.
ALIASES = {"hvd_trainer.keras": "hvd_trainer.tensorflow.keras"}
NOT_PUBLIC = {"require", "PYTORCH", "MXNET", "TENSORFLOW", "tf", "np", "mx", "torch", "Any",
              "Optional", "List", "Dict", "Tuple", "Callable"}


def _bound(name: str) -> Dict[str, ast.AST]:
    """What module ``name`` binds at its top level, by name (imports included)."""
    bound: Dict[str, ast.AST] = {}
    for node in TREES[name].body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        bound[sub.id] = node
    return bound


def _lazy(name: str) -> List[str]:
    """The names module ``name``'s ``__getattr__`` serves (string constants compared there)."""
    for node in TREES[name].body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return [c.value for c in ast.walk(node)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return []


def _all(name: str) -> Optional[List[str]]:
    """Module ``name``'s ``__all__``, a literal list or one imported from another module."""
    for node in TREES[name].body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
        if isinstance(node, ast.ImportFrom) and any(a.name == "__all__" for a in node.names):
            return _all(_absolute(name, node))
    return None


def _absolute(name: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in module ``name`` reads from."""
    if not node.level:
        return node.module
    package = name if MODULES[name].endswith("__init__.py") else name.rpartition(".")[0]
    parts = package.split(".")
    base = parts[:len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@pytest.mark.parametrize("face", sorted(FACES))
def test_a_face_declares_all_and_binds_each_name(face):
    names = _all(face)
    assert names is not None, f"{face} has no __all__"
    assert len(names) == len(set(names)), f"{face}.__all__ names something twice"
    bound = _bound(face)
    star = any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)
               for n in TREES[face].body)
    missing = [n for n in names if n not in bound and n not in _lazy(face) and not star
               and f"{face}.{n}" not in MODULES]  # a submodule is bound when imported
    assert missing == [], f"{face}.__all__ names what it does not bind: {missing}"
    assert not set(names) & NOT_PUBLIC, f"{face}.__all__ makes {set(names) & NOT_PUBLIC} public"


@functools.lru_cache(maxsize=None)
def _generator():
    """docs/hooks/generate.py, loaded once (it reads the package with griffe once)."""
    spec = importlib.util.spec_from_file_location(
        "docs_generate", os.path.join(REPO, "docs", "hooks", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("face", sorted(f for f, page in FACES.items() if page.startswith("api/")))
def test_each_name_of_a_face_is_in_the_api_reference(face):
    if importlib.util.find_spec("griffe") is None:
        pytest.skip("griffe is not installed here; the [test] extra installs it")
    with open(os.path.join(REPO, "docs", FACES[face]), encoding="utf-8") as f:
        page = f.read()
    generator = _generator()
    rendered = set()
    for shown in re.findall(r"<!-- api: ([\w.]+) -->|^::: ([\w.]+)", page, re.M):
        module = shown[0] or shown[1]
        if module.partition(".")[0] != "hvd_trainer":
            continue  # a launcher object shown under its public name (hvd_trainer.run)
        names, plain, submodules = generator.public_names(module)
        rendered.update(f"{module}.{n}" for n in names + plain)
        rendered.update(submodules)
        rendered.add(module)
        members = re.search(rf"^::: {re.escape(module)}\n    options:\n      members: \[(.*?)\]",
                            page, re.M)
        if members:  # a section that lists its members itself
            rendered.update(f"{module}.{n.strip()}" for n in members.group(1).split(","))
    shown_as = ALIASES.get(face, face)
    missing = [n for n in _all(face) if f"{shown_as}.{n}" not in rendered
               and f"`{face}.{n}`" not in page]
    assert missing == [], f"{FACES[face]} does not document {face}'s {missing}"


# -- cross-references -------------------------------------------------------------------------
ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`([^`]+)`")
# Module names of the package: a reference that starts with one names something of ours.
OUR_NAMES = {part for name in MODULES for part in name.split(".")}


def _class_members(module: str, cls: ast.ClassDef) -> Tuple[set, List[str]]:
    """What class ``cls`` of ``module`` defines (methods, class attributes, attributes its
    methods set on self), and the dotted names of its bases."""
    members = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and getattr(node.value, "id", None) == "self":
            members.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Name):
                    members.add(target.id)
    return members, [ast.unparse(b) for b in cls.bases]


def _resolve(dotted: str) -> bool:
    """Whether the absolute ``dotted`` name exists (names outside the package: assumed)."""
    parts = dotted.split(".")
    if parts[0] != "hvd_trainer":
        return True
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in MODULES:
            return _resolve_in(module, parts[i:])
    return False


def _resolve_in(module: str, rest: List[str]) -> bool:
    if not rest:
        return True
    bound = _bound(module).get(rest[0])
    if bound is None:
        if f"{module}.{rest[0]}" in MODULES:
            return _resolve_in(f"{module}.{rest[0]}", rest[1:])
        return rest[0] in _lazy(module) and len(rest) == 1
    if isinstance(bound, ast.ImportFrom):
        alias = next(a for a in bound.names if (a.asname or a.name) == rest[0])
        return _resolve(".".join([_absolute(module, bound), alias.name] + rest[1:]))
    if isinstance(bound, ast.Import):
        return _resolve(".".join([rest[0]] + rest[1:]))
    if isinstance(bound, ast.ClassDef):
        return _resolve_member(module, bound, rest[1:])
    return len(rest) == 1


def _resolve_member(module: str, cls: ast.ClassDef, rest: List[str]) -> bool:
    if not rest:
        return True
    members, bases = _class_members(module, cls)
    if rest[0] in members:
        return len(rest) == 1
    for base in bases:
        bound = _bound(module).get(base.split(".")[0])
        if isinstance(bound, ast.ClassDef):
            if _resolve_member(module, bound, rest):
                return True
        elif isinstance(bound, ast.ImportFrom):
            alias = next(a for a in bound.names if (a.asname or a.name) == base.split(".")[0])
            target = _absolute(module, bound)
            if not target.startswith("hvd_trainer"):
                return True  # a framework's class: its members are not ours to check
            if _resolve(".".join([target, alias.name] + rest)):
                return True
        else:
            return True  # a base from outside the package
    return False


def _reference_exists(ref: str, module: str, cls: Optional[ast.ClassDef]) -> bool:
    """Whether reference ``ref`` in a docstring of ``module`` (inside class ``cls``) names
    something that exists, as Sphinx would look it up."""
    ref = ref.split("<")[-1].rstrip(">").lstrip("~").rstrip("()")
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    if ref.startswith("."):
        dots = len(ref) - len(ref.lstrip("."))
        base = package.split(".")[:len(package.split(".")) - dots + 1]
        return _resolve(".".join(base + [ref.lstrip(".")]))
    parts = ref.split(".")
    if parts[0] == "hvd_trainer":
        return _resolve(ref)
    if parts[0] in _bound(module):
        return _resolve_in(module, parts)
    if cls is not None and _resolve_member(module, cls, parts):
        return True
    if f"{package}.{parts[0]}" in MODULES:
        return _resolve(f"{package}.{ref}")
    return parts[0] not in OUR_NAMES  # another package's name (numpy, torch, horovod, ...)


def _docstrings(module: str):
    """(docstring, enclosing class) of the module and of each class and function in it."""
    tree = TREES[module]
    yield ast.get_docstring(tree) or "", None

    def walk(node, cls):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield ast.get_docstring(child) or "", cls
                yield from walk(child, child if isinstance(child, ast.ClassDef) else cls)
    yield from walk(tree, None)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_docstring_cross_reference_resolves(module):
    broken = [ref for text, cls in _docstrings(module) for ref in ROLE.findall(text)
              if not _reference_exists(ref, module, cls)]
    assert broken == [], f"{module}: cross-references to nothing: {broken}"


def test_the_reference_reader_finds_what_is_missing():
    module = "hvd_trainer.cuda.compression"
    assert _reference_exists("~hvd_trainer.collectives.feedback.ErrorFeedbackSum", module, None)
    assert not _reference_exists("compression.ErrorFeedbackSum", module, None)
    assert not _reference_exists("hvd_trainer.training.steps", module, None)
    assert _reference_exists("numpy.ndarray", module, None)
    assert _reference_exists(".reducer.Reducer.mark", "hvd_trainer.training.step", None)
