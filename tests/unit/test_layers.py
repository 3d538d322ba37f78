"""The package's layers, read from its source: no import circles; each subpackage imports only
the layers pinned for it, never one above its own; nothing reaches around a layer (adapters
never import mpi4py; backends never import a framework; the core never imports an adapter);
the launcher does not import the package. Imports inside functions count too."""
import ast
import os
from typing import Dict, List, Set

import pytest

# The same in every environment: CI checks it in its first pass only.
pytestmark = pytest.mark.tree

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "hvd_trainer")
ADAPTERS = ("hvd_trainer.mxnet", "hvd_trainer.torch", "hvd_trainer.tensorflow", "hvd_trainer.keras")
FRAMEWORKS = ("mxnet", "torch", "tensorflow", "keras")


def _modules() -> Dict[str, str]:
    """Module name -> file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))
                name = rel[:-3].replace(os.sep, ".")
                found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = \
                    os.path.join(folder, f)
    return found


MODULES = _modules()


def _loads_by_name(tree: ast.AST) -> bool:
    """Whether a module imports modules by name at run time (importlib, __import__)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called in ("importlib.import_module", "import_module", "__import__"):
                return True
    return False


def _imports(name: str) -> Set[str]:
    """Every module ``name`` imports (absolute names), at module level or in functions; in a
    module that imports by name (importlib), every string that names one of the package's
    modules counts as an import of it too."""
    path = MODULES[name]
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(open(path).read())
    if _loads_by_name(tree):
        out.update(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                   and isinstance(node.value, str) and node.value in MODULES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in MODULES else base)
    return out


GRAPH = {name: {m for m in _imports(name) if m in MODULES and m != name} for name in MODULES}


def _cycle() -> List[str]:
    """One import circle among the package's modules, or []."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            # A package's __init__ runs before its modules; edges into it from inside are not
            # layering, so only a module-to-module circle counts.
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for name in sorted(GRAPH):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return []


def test_no_import_circle():
    assert _cycle() == []


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(ADAPTERS)))
def test_adapters_never_import_mpi4py(name):
    assert not any(m.split(".")[0] == "mpi4py" for m in _imports(name))


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("hvd_trainer.backends")))
def test_backends_never_import_a_framework(name):
    assert not any(m.split(".")[0] in FRAMEWORKS for m in _imports(name))


# The Spark estimators are engine entry points above the adapters: they train with them.
ESTIMATORS = ("hvd_trainer.spark.torch", "hvd_trainer.spark.keras", "hvd_trainer.spark.lightning")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.startswith(ADAPTERS)
                                        and not n.startswith(ESTIMATORS)
                                        and n != "hvd_trainer"))
def test_the_core_never_imports_an_adapter(name):
    assert not any(m.startswith(ADAPTERS) for m in _imports(name))


# The layers, lowest first, as the imports are after the core's move into subpackages
# (issue 35). A layer's modules may import each other and the layers pinned for it below;
# two layers of one rank (training and elastic, say) do not import each other.
LAYER_RANKS = {
    "backends": 0,                      # Communicator implementations over MPI, NCCL, one rank
    "runtime": 1,                       # the world, settings, safe files, timeline
    "coordination": 2,                  # scheduling, matching, agreement
    "collectives": 3,                   # operations on arrays and objects
    "compression": 4,                   # codecs, and PowerSGD's settings (its sums: collectives)
    "training": 5, "elastic": 5, "cuda": 5,  # reducer and steps; elastic state; GPU kernels
    "mxnet": 6, "torch": 6, "tensorflow": 6, "keras": 6,  # framework adapters
    "runner": 6, "ray": 6,  # hvd_trainer.run and the engines: launcher side
    "spark": 7,  # spark.run, and the estimators, which train with the adapters
}
ALLOWED_IMPORTS = {
    "backends": set(),
    "runtime": {"backends"},
    "coordination": {"backends", "runtime"},
    "collectives": {"backends", "runtime", "coordination"},
    "compression": {"collectives"},
    "training": {"backends", "runtime", "coordination", "collectives", "compression"},
    "elastic": {"runtime", "collectives"},
    "cuda": {"backends", "runtime", "collectives", "compression"},
    "mxnet": {"backends", "runtime", "coordination", "collectives", "compression", "training",
              "elastic"},
    "torch": {"backends", "runtime", "coordination", "collectives", "compression", "training",
              "elastic", "cuda"},
    "tensorflow": {"runtime", "coordination", "collectives", "compression", "training",
                   "elastic"},
    "keras": {"tensorflow"},
    "runner": set(), "ray": set(),
    # The estimators' stores write with runtime's safe files; they train with the adapters.
    "spark": {"runtime", "torch", "tensorflow", "keras"},
}


def _layer(name: str) -> str:
    """The layer of module ``name``: its subpackage, or a top-level module's own name."""
    return name.split(".")[1]


LAYERED = sorted(n for n in MODULES if n != "hvd_trainer")
LAYER_IMPORTS = {layer: {_layer(m) for n in LAYERED if _layer(n) == layer for m in GRAPH[n]
                         if m != "hvd_trainer"} - {layer} for layer in LAYER_RANKS}


@pytest.mark.parametrize("name", LAYERED)
def test_every_module_has_a_layer(name):
    assert _layer(name) in LAYER_RANKS and _layer(name) in ALLOWED_IMPORTS


@pytest.mark.parametrize("layer", sorted(LAYER_RANKS))
def test_a_layer_imports_only_the_layers_pinned_for_it(layer):
    assert LAYER_IMPORTS[layer] <= ALLOWED_IMPORTS[layer]


@pytest.mark.parametrize("layer", sorted(LAYER_RANKS))
def test_nothing_imports_upward_or_sideways(layer):
    assert {m for m in LAYER_IMPORTS[layer] if LAYER_RANKS[m] >= LAYER_RANKS[layer]} \
        <= ({"tensorflow"} if layer == "keras" else set())  # keras is tensorflow.keras's alias


def test_the_pinned_layers_point_down():
    for layer, allowed in ALLOWED_IMPORTS.items():
        assert all(LAYER_RANKS[m] < LAYER_RANKS[layer] for m in allowed if layer != "keras")


def test_the_layer_reader_sees_the_layers():
    assert LAYER_IMPORTS["collectives"] == {"backends", "runtime", "coordination"}
    assert "hvd_trainer.coordination.agreement" in GRAPH["hvd_trainer.collectives.ops"]


LAUNCH = os.path.join(os.path.dirname(ROOT), "hvd_trainer_launch")
LAUNCHER_FILES = sorted(os.path.relpath(os.path.join(folder, f), LAUNCH)
                        for folder, _, files in os.walk(LAUNCH) for f in files if f.endswith(".py"))


@pytest.mark.parametrize("file", LAUNCHER_FILES)
def test_the_launcher_does_not_import_the_package(file):
    # The core imports the launcher's protocol, files and install hints, so the launcher
    # (hvdrun, a rank's wrapper, an engine's agent) imports nothing of the core: no loop.
    found = set()
    for node in ast.walk(ast.parse(open(os.path.join(LAUNCH, file)).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{a.name}" for a in node.names)
    assert {m for m in found if m.split(".")[0] == "hvd_trainer"} == set()


def test_the_launcher_reader_walks_its_folders():
    assert os.path.join("job", "watch.py") in LAUNCHER_FILES


def test_the_reader_sees_imports_by_name():
    assert "hvd_trainer.cuda.ops" in GRAPH["hvd_trainer"]  # the package registers the GPU
    assert "hvd_trainer.cuda.ops" not in GRAPH["hvd_trainer.collectives.memory"]
    tree = ast.parse("import importlib\nimportlib.import_module(WHERE['x'])\n")
    assert _loads_by_name(tree)


def test_the_reader_finds_imports_inside_functions():
    # runtime.py imports its MPI backend only when it makes the world: the reader must see it.
    assert "hvd_trainer.backends.mpi" in GRAPH["hvd_trainer.runtime.runtime"]


# Each adapter's training machinery: the files of its optimizer or trainer. The step protocol
# around the reducer is the core's (steps.py), so each stays a bridge of tensors and names.
TRAINING_FILES = ["hvd_trainer.mxnet.trainer", "hvd_trainer.mxnet.gradients",
                  "hvd_trainer.mxnet.optimizer", "hvd_trainer.mxnet.sparse_weights",
                  "hvd_trainer.torch.optimizer", "hvd_trainer.torch.gradients",
                  "hvd_trainer.torch.adasum_optimizer", "hvd_trainer.tensorflow.gradients",
                  "hvd_trainer.tensorflow.tape", "hvd_trainer.tensorflow.keras"]
# Of those, the ones that drive a reducer's steps: a collective of theirs would run around it.
STEP_FILES = ["hvd_trainer.mxnet.trainer", "hvd_trainer.mxnet.gradients",
              "hvd_trainer.mxnet.optimizer", "hvd_trainer.torch.optimizer",
              "hvd_trainer.torch.gradients"]


@pytest.mark.parametrize("name", TRAINING_FILES)
def test_an_adapters_training_file_has_under_300_lines(name):
    with open(MODULES[name]) as f:
        assert len(f.read().splitlines()) < 300


def _core_modules_bound(name: str) -> Set[str]:
    """The core modules that ``name``, an adapter's module, binds as module objects
    (``from ..collectives import ops``)."""
    bound = set()
    for node in ast.walk(ast.parse(open(MODULES[name]).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 2:
            base = "hvd_trainer" + (f".{node.module}" if node.module else "")
            bound.update(alias.name for alias in node.names if f"{base}.{alias.name}" in MODULES)
        elif isinstance(node, ast.Import):
            bound.update(a.name.rpartition(".")[2] for a in node.names
                         if a.name.startswith("hvd_trainer."))
    return bound


@pytest.mark.parametrize("name", STEP_FILES)
def test_an_adapter_makes_no_core_collective_around_the_reducer(name):
    # The core's collectives live in ops (and objects, sparse, adasum); an adapter's step files
    # reach them only through the reducer and steps.py.
    assert not _core_modules_bound(name) & {"ops", "objects", "sparse", "adasum", "joined"}


def test_the_reader_finds_module_bindings():
    assert "ops" in _core_modules_bound("hvd_trainer.mxnet.parameters")


# The coordination code: rounds, records and turns that every rank must read alike. Records
# there are named (NamedTuples, dataclasses), so no tuple element is read by position. The
# reads by a literal index that remain are the heads of lists (a round's entries, the ranks'
# values) and an exception's message, each listed here by module and expression.
COORDINATION = sorted(n for n in MODULES if n.startswith("hvd_trainer.coordination.")) + [
    "hvd_trainer.collectives.joined"]
LIST_HEADS = {
    "hvd_trainer.coordination.matching": {"active[0]", "described[0]", "oldest[0]",
                                          "error.args[0]", "error.args[1:]", "by_rank[1:]"},
    "hvd_trainer.coordination.scheduler": {"self.ready[0]"},
    "hvd_trainer.coordination.work_order": {"_closers.setdefault(me, [])[:0]"},
    "hvd_trainer.coordination.rounds": {"entries[0]"},
    "hvd_trainer.coordination.messages": {"values[0]", "every[0]"},
    "hvd_trainer.collectives.joined": {"sets[1:]"},
    "hvd_trainer.coordination.process_sets": {"odd[0]"},
}


def _literal_index_reads(source: str) -> Set[str]:
    """The expressions in ``source`` that subscript with an integer literal or a slice with
    one (``x[2]``, ``x[-1]``, ``x[:2]``)."""
    def literal(node: ast.AST) -> bool:
        if isinstance(node, ast.UnaryOp):
            node = node.operand
        return isinstance(node, ast.Constant) and isinstance(node.value, int)

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript):
            index = node.slice
            if literal(index) or (isinstance(index, ast.Slice) and any(
                    part is not None and literal(part)
                    for part in (index.lower, index.upper, index.step))):
                found.add(ast.unparse(node))
    return found


@pytest.mark.parametrize("name", COORDINATION)
def test_the_coordination_code_reads_no_tuple_element_by_position(name):
    with open(MODULES[name]) as f:
        assert _literal_index_reads(f.read()) - LIST_HEADS.get(name, set()) == set()


def test_the_index_reader_finds_positional_reads():
    assert _literal_index_reads("item[:2]; g[2]; s[-1]; x[k]; d['a']") == {
        "item[:2]", "g[2]", "s[-1]"}


# A module does one job in at most this many lines, a function in at most FUNCTION_LINES
# (from its first decorator to its last line). Checked in these trees: the package, adapters
# included, and the launcher (launch/elastic.py had 616 lines and a 119-line run before
# issue 47's reorganisation).
MODULE_LINES = 500
FUNCTION_LINES = 80
SIZE_CHECKED = {"hvd_trainer": ROOT, "hvd_trainer_launch": LAUNCH}


def _python_files(trees: Dict[str, str]) -> List[str]:
    """Every Python file of the ``trees`` (name -> folder), relative to the repository."""
    found = []
    for folder in trees.values():
        for parent, _, files in os.walk(folder):
            found += [os.path.relpath(os.path.join(parent, f), os.path.dirname(ROOT))
                      for f in files if f.endswith(".py")]
    return sorted(found)


SIZED = _python_files(SIZE_CHECKED)


def _long_functions(source: str, limit: int) -> List[str]:
    """The functions of ``source`` longer than ``limit`` lines, with their lengths."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - first + 1 > limit:
                found.append(f"{node.name} ({node.end_lineno - first + 1} lines)")
    return found


@pytest.mark.parametrize("path", SIZED)
def test_a_module_fits_the_size_limit(path):
    with open(os.path.join(os.path.dirname(ROOT), path)) as f:
        assert len(f.read().splitlines()) <= MODULE_LINES


@pytest.mark.parametrize("path", SIZED)
def test_a_function_fits_the_size_limit(path):
    with open(os.path.join(os.path.dirname(ROOT), path)) as f:
        assert _long_functions(f.read(), FUNCTION_LINES) == []


def test_the_size_reader_measures_functions_with_their_decorators():
    source = "@decorate\ndef f():\n" + "    x = 1\n" * 3
    assert _long_functions(source, 5) == [] and _long_functions(source, 4) == ["f (5 lines)"]


# No module writes another module's objects' underscore attributes: an object's private
# state is changed by its own class's methods. (A framework's private attributes that an
# adapter must set to keep the framework's semantics, such as MXNet's _fresh_grad, are not
# the package's and are not checked.)
def _private_names_of_classes() -> Dict[str, Set[str]]:
    """Module -> the underscore attributes that its classes set on self."""
    owned: Dict[str, Set[str]] = {}
    for name, path in MODULES.items():
        names: Set[str] = set()
        for cls in (n for n in ast.walk(ast.parse(open(path).read()))
                    if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and getattr(node.value, "id", None) in ("self", "cls") \
                        and _private(node.attr):
                    names.add(node.attr)
        owned[name] = names
    return owned


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _foreign_private_writes(source: str) -> List[str]:
    """Writes in ``source`` to an underscore attribute of an object other than self or cls:
    stores, augmented stores and deletions of ``x._a`` and ``x._a[...]``, and
    ``setattr(x, "_a", ...)`` / ``object.__setattr__(x, "_a", ...)``; as (attribute, text)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: List[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets
                       for t in (target.elts if isinstance(target, (ast.Tuple, ast.List))
                                 else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "setattr", "object.__setattr__") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and getattr(node.args[0], "id", None) not in ("self", "cls") \
                and _private(str(node.args[1].value)):
            found.append((node.args[1].value, ast.unparse(node)))
        for target in targets:
            attribute = target.value if isinstance(target, ast.Subscript) else target
            if isinstance(attribute, ast.Attribute) and _private(attribute.attr) \
                    and getattr(attribute.value, "id", None) not in ("self", "cls"):
                found.append((attribute.attr, ast.unparse(target)))
    return found


OWNED = _private_names_of_classes()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_writes_another_modules_private_state(name):
    with open(MODULES[name]) as f:
        writes = _foreign_private_writes(f.read())
    theirs = [text for attr, text in writes if attr not in OWNED[name]
              and any(attr in names for other, names in OWNED.items() if other != name)]
    assert theirs == []


def test_the_private_write_reader_finds_writes():
    source = ("step._marks[p] = 1\nstep._left -= 1\nself._ok = 2\nx.public = 3\n"
              "object.__setattr__(t, '_r', 1)\nsetattr(self, '_s', 1)\n")
    assert [attr for attr, _ in _foreign_private_writes(source)] == ["_marks", "_left", "_r"]
