"""Where the test bed cannot be built, every multi-host test skips, naming what is missing and
how to get it, instead of failing or waiting: without sshd (HVD_TESTBED_SSHD pointed at a
missing path), in a container whose root may not make network namespaces (a user namespace
stands for one), and as a user other than root. Each case runs tests/multihost in a pytest of
its own; the other tests here check the reason given for each missing daemon and command."""
import os
import re
import shutil
import subprocess
import sys

import pytest

import testbed

HERE = os.path.dirname(os.path.abspath(__file__))
# Reasons that do not depend on the bed, which a test may give first.
OTHER_REASONS = ("ULFM needs Open MPI 5", "not installed here")
NOBODY = 65534


def _user_namespace():
    """The command that runs a program as root of a user namespace of its own, where root may
    not make network namespaces (as in a container); skip where there is none."""
    wrapper = ["unshare", "--user", "--map-root-user"]
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` here (apt-get install util-linux)")
    probe = subprocess.run([*wrapper, "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no user namespace here to stand for a container: {probe.stderr.strip()}")
    return wrapper


def _nobody():
    """The command that runs a program as user nobody (from root)."""
    wrapper = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if shutil.which("setpriv") is None:
        pytest.skip("no `setpriv` here (apt-get install util-linux)")
    probe = subprocess.run([*wrapper, sys.executable, "-c", "import pytest, hvd_trainer"],
                           capture_output=True, text=True, cwd=HERE)
    if probe.returncode:
        pytest.skip("user nobody cannot run this checkout's Python (make it and its venv "
                    f"readable by others): {probe.stderr.strip()[-300:]}")
    return wrapper


def _conditions(case):
    """How to run a pytest in ``case``'s conditions: (wrapper command, variables)."""
    root = os.geteuid() == 0
    if case == "no sshd":  # a user other than root is told first that root is needed
        return ([] if root else _user_namespace()), {"HVD_TESTBED_SSHD": "/nonexistent/sshd"}
    if case == "container":  # whatever the machine lacks besides, the namespace is refused
        for tool, package in testbed.TOOLS.items():
            if shutil.which(tool) is None:
                pytest.skip(f"`{tool}` is not installed here (apt-get install {package})")
        return _user_namespace(), {"HVD_TESTBED_SSHD": sys.executable}
    return (_nobody() if root else []), {}


CASES = {
    # case: the reason every test that needs the bed must give
    "no sshd": "the multi-host test bed needs /nonexistent/sshd (apt-get install "
               "openssh-server, or point HVD_TESTBED_SSHD at it)",
    "container": "cannot make a network namespace here",
    "not root": "the multi-host test bed needs root",
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_multihost_test_skips_naming_what_is_missing(case):
    wrapper, variables = _conditions(case)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **variables)
    proc = subprocess.run([*wrapper, sys.executable, "-m", "pytest", HERE, "-q", "-rsfE",
                           "-p", "no:cacheprovider", "--ignore", os.path.abspath(__file__)],
                          capture_output=True, text=True, env=env, cwd=HERE, timeout=600)
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1]
    assert proc.returncode == 0 and re.fullmatch(r"\d+ skipped in .*", summary), out
    reason = CASES[case]
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", proc.stdout, re.M)
    assert any(r.startswith(reason) for r in reasons), out
    assert all(r.startswith(reason) or any(o in r for o in OTHER_REASONS) for r in reasons), out


def _path_without(tmp_path, missing, needed):
    """A folder for PATH holding a stand-in (an empty executable) for each command ``needed``
    but ``missing``: the checks look commands up, they do not run them."""
    folder = tmp_path / f"without-{missing}"
    folder.mkdir()
    for tool in needed:
        if tool != missing:
            (folder / tool).touch(mode=0o755)
    return str(folder)


def test_each_missing_command_and_daemon_is_named_with_its_package(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # past the check for root, as root is
    present = sys.executable  # stands for each daemon when it is there
    for daemon in (testbed.SSHD, testbed.MUNGED, testbed.SLURMCTLD, testbed.SLURMD):
        monkeypatch.setenv(daemon.variable, present)
    for tool, package in testbed.TOOLS.items():
        monkeypatch.setenv("PATH", _path_without(tmp_path, tool, testbed.TOOLS))
        assert testbed.unavailable() == \
            f"the multi-host test bed needs `{tool}` on PATH (apt-get install {package})"
    for tool, package in testbed.SLURM_TOOLS.items():
        monkeypatch.setenv("PATH", _path_without(tmp_path, tool, testbed.SLURM_TOOLS))
        assert testbed.slurm_unavailable() == \
            f"Slurm on the test bed needs `{tool}` on PATH (apt-get install {package})"
    for daemon in (testbed.MUNGED, testbed.SLURMCTLD, testbed.SLURMD):
        gone = str(tmp_path / "gone" / os.path.basename(daemon.default))
        monkeypatch.setenv(daemon.variable, gone)
        assert testbed.slurm_unavailable() == (
            f"Slurm on the test bed needs {gone} (apt-get install {daemon.package}, or point "
            f"{daemon.variable} at it)")
        monkeypatch.setenv(daemon.variable, present)
