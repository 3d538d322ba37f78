"""pyproject.toml lists every package of the source tree: an installed (not editable) copy
would otherwise lack a subpackage, which only a non-editable install shows. The version is
written once, in hvd_trainer/__init__.py, and pyproject.toml reads it from there."""
import os
import re

import pytest

# The same in every environment: CI checks it in its first pass only.
pytestmark = pytest.mark.tree

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.9 and 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs Python 3.11's "
                                                  "tomllib or tomli (pip install tomli)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_every_folder_with_an_init_is_a_listed_package():
    found = set()
    for top in ("hvd_trainer", "hvd_trainer_launch"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            if "__init__.py" in files:
                found.add(os.path.relpath(folder, REPO).replace(os.sep, "."))
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert found - listed == set()


def test_the_version_is_read_from_the_package_alone():
    project = _pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "hvd_trainer.__version__"}
    with open(os.path.join(REPO, "hvd_trainer", "__init__.py")) as f:
        assert len(re.findall(r"^__version__ = \"[^\"]+\"$", f.read(), re.M)) == 1
    assert not os.path.exists(os.path.join(REPO, "setup.py"))
