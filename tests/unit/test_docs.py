"""The docs site: it builds in strict mode, its scripts run, its diffs are the examples' diffs,
and the tables it generates from the code cover the code.

Marked blocks: a fenced ``python`` block right after ``<!-- run: COMMAND -->`` is a complete
script, run here by COMMAND (``python``, or ``hvdrun ...`` with its flags); a ``diff`` block
right after ``<!-- diff: OLD NEW -->`` shows every line that ``diff OLD NEW`` adds or removes.
"""
import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

# The same in every environment: CI checks it in its first pass only.
pytestmark = pytest.mark.tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
RUN = re.compile(r"<!-- run: ([^\n]*?) -->\n```python\n(.*?)\n```", re.S)
DIFF = re.compile(r"<!-- diff: (\S+) (\S+) -->\n```diff\n(.*?)\n```", re.S)
FRAMEWORK = re.compile(r"^\s*(?:import|from)\s+(?:hvd_trainer\.)?(mxnet|torch|tensorflow|keras)\b",
                       re.M)


def _load_generator():
    spec = importlib.util.spec_from_file_location("docs_generate",
                                                  os.path.join(DOCS, "hooks", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(pattern, paths):
    found = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for i, match in enumerate(pattern.finditer(text)):
            found.append(pytest.param(*match.groups(),
                                      id=f"{os.path.relpath(path, REPO)}:{i}"))
    return found


SCRIPTS = _blocks(RUN, PAGES)
DIFFS = _blocks(DIFF, PAGES + [os.path.join(REPO, "README.md")])


def test_the_site_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed here; the [test] and [test-tensorflow] extras "
                    "install it (pip install -e '.[test]')")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The generated tables and the API reference made it into the pages.
    with open(tmp_path / "site" / "configuration" / "index.html", encoding="utf-8") as f:
        configuration = f.read()
    assert "HVD_BUCKET_THRESHOLD" in configuration and "--blacklist-cooldown-range" in configuration
    with open(tmp_path / "site" / "api" / "torch" / "index.html", encoding="utf-8") as f:
        api = f.read()
    assert 'id="hvd_trainer.torch.DistributedOptimizer"' in api
    assert "<code>synchronize</code>" in api and not re.search(r":(func|class|meth|mod):<code>", api)


def test_the_docs_have_scripts_and_diffs_to_check():
    # A marker that stopped matching (a renamed fence, a typo) would silently drop its block.
    assert len(SCRIPTS) >= 5 and len(DIFFS) >= 6
    marked = sum(open(p, encoding="utf-8").read().count("<!-- run:") for p in PAGES)
    assert marked == len(SCRIPTS)


@pytest.mark.parametrize("command, script", SCRIPTS)
def test_the_docs_scripts_run(tmp_path, command, script):
    missing = [name for name in sorted(set(FRAMEWORK.findall(script)))
               if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed here; this script runs in the "
                    "environment that has it, see the README")
    path = tmp_path / "script.py"
    path.write_text(script + "\n")
    words = shlex.split(command)
    if words == ["python"]:
        argv = [sys.executable, str(path)]
    else:
        assert words[0] == "hvdrun", f"unknown run command {command!r}"
        argv = [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", *words[1:], sys.executable,
                str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("OMPI_MCA_btl", "^ofi,uct")
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("old, new, shown", DIFFS)
def test_the_docs_diffs_are_the_examples_diffs(old, new, shown):
    # The pages quote `diff OLD NEW`, so GNU diff is the reference (its choice among equally
    # short diffs is the one shown): each "<" line a "-", each ">" line a "+", in its order.
    if shutil.which("diff") is None:
        pytest.skip("no diff command here (apt-get install diffutils)")
    proc = subprocess.run(["diff", old, new], cwd=REPO, capture_output=True, text=True)
    changed = [("-" if line[0] == "<" else "+") + line[2:]
               for line in proc.stdout.splitlines() if line[:2] in ("< ", "> ", "<", ">")]
    assert shown.splitlines() == changed


def test_a_variable_the_docs_do_not_describe_fails_the_build(monkeypatch):
    generate = _load_generator()
    generate.check_variables()  # the docs describe what the code has
    monkeypatch.delitem(generate.SETTINGS, "HVD_RING_THRESHOLD")
    monkeypatch.setitem(generate.SET_BY_HVDRUN, "HVD_GONE", "a variable the code lost")
    with pytest.raises(ValueError, match=r"describe \['HVD_RING_THRESHOLD'\].*drop \['HVD_GONE'\]"):
        generate.check_variables()


def test_the_variables_found_in_the_code_include_every_kind_of_read():
    names = set(_load_generator().variables_in_code())
    assert {"HVD_RING_THRESHOLD",  # only in config.AGREED_SETTINGS
            "HVD_TIMELINE",  # read through config.env("TIMELINE")
            "HVD_MPIEXEC",  # a literal in hvd_trainer_launch/
            "HVDRUN_WORKER"} <= names  # set by hvdrun's wrapper
    assert all(re.fullmatch(r"(HVD|HVDRUN)_[A-Z0-9_]+", name) for name in names)


def test_the_settings_table_takes_its_defaults_from_the_code():
    from hvd_trainer.runtime import config
    rows = {row.split(" | ")[0].strip("| `"): row
            for row in _load_generator().settings_table().splitlines()[2:]}
    assert f"| {config.DEFAULT_BUCKET_THRESHOLD} ({config.DEFAULT_BUCKET_THRESHOLD >> 20} MiB) |" \
        in rows["HVD_BUCKET_THRESHOLD"]
    assert "| 60 | each rank's |" in rows["HVD_STALL_CHECK_TIME_SECONDS"]
    assert set(rows) == set(_load_generator().SETTINGS)


def test_the_readme_links_to_docs_pages_that_exist():
    with open(os.path.join(REPO, "README.md")) as f:
        links = re.findall(r"\]\((docs/[^)#]+)", f.read())
    assert links and all(os.path.isfile(os.path.join(REPO, link)) for link in links), links


def test_nothing_in_the_tree_points_at_readme_sections_that_moved():
    # The README keeps only the opening commands; sections live in docs/ now.
    stale = re.compile(r"README'?s? (?:\w+ )?(?:section|table)|README, \w|see the README's")
    hits = []
    for top in ("hvd_trainer", "hvd_trainer_launch", "tests", "benchmarks", "examples"):
        for path in glob.glob(os.path.join(REPO, top, "**", "*"), recursive=True):
            if os.path.isfile(path) and path.endswith((".py", ".md", ".sh")) \
                    and os.path.abspath(path) != os.path.abspath(__file__):
                with open(path, encoding="utf-8", errors="replace") as f:
                    hits += [f"{os.path.relpath(path, REPO)}: {m.group(0)}"
                             for m in stale.finditer(f.read())]
    assert not hits, hits


def _design_tree() -> str:
    """docs/design.md's tree of the repository (its last block that lists hvd_trainer_launch/)."""
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```\n(.*?)```", f.read(), re.S)
    return next(block for block in reversed(blocks) if "\nhvd_trainer_launch/" in block)


def test_the_design_tree_names_every_launcher_module_under_its_folder():
    # A stranger finds each launcher module (where the Spark driver code is, which module
    # signs files) in docs/design.md: each folder's modules listed under it.
    tree = _design_tree().split("\nhvd_trainer_launch/", 1)[1].split("\n")
    listed, folder = set(), ""
    for line in tree:
        if not line.startswith("  ") and line.strip():
            break  # the next top-level entry
        name = line.strip().split(" ")[0] if line.strip() else ""
        if line.startswith("    ") and name.endswith(".py"):
            listed.add(f"{folder}/{name}")
        elif line.startswith("  ") and not line.startswith("    ") and name:
            folder = name.rstrip("/") if name.endswith("/") else ""
            if name.endswith(".py"):
                listed.add(name)
    root = os.path.join(REPO, "hvd_trainer_launch")
    found = {os.path.relpath(os.path.join(parent, f), root)
             for parent, _, files in os.walk(root) for f in files
             if f.endswith(".py") and f != "__init__.py"}
    assert "engines/spark_run.py" in found and found - listed == set()
