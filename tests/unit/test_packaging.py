"""setup.py lists every package of the source tree: an installed (not editable) copy would
otherwise lack a subpackage, which only a non-editable install shows."""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _listed_packages():
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "packages":
            return set(ast.literal_eval(node.value))
    raise AssertionError("setup.py passes no packages= list")


def test_every_folder_with_an_init_is_a_listed_package():
    found = set()
    for folder, _, files in os.walk(os.path.join(REPO, "hvd_trainer")):
        if "__init__.py" in files:
            found.add(os.path.relpath(folder, REPO).replace(os.sep, "."))
    assert found - _listed_packages() == set()
