"""The rank wrapper (hvd_trainer_launch.worker) run directly, without MPI: how it reports its
child's exit to hvdrun. A child that ended before the launcher's SIGTERM reached the wrapper
failed on its own; one that the SIGTERM ended was ended by the launcher (issue 22: after a
remote kill -9, Open MPI signalled every rank, the killed one's wrapper included, before that
wrapper had woken to its child's end, and hvdrun named a survivor)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

MARKER = re.compile(r"#hvdrun-exit rank=3 code=(\d+) at=([\d.]+)( killed)?( ended)?")


def start_wrapper():
    """The wrapper as rank 3 around a child that sleeps; returns it and the child's pid once the
    child runs."""
    env = dict(os.environ, PMI_RANK="3")
    wrapper = subprocess.Popen([sys.executable, "-m", "hvd_trainer_launch.worker", "--",
                                sys.executable, "-c", "import time; time.sleep(60)"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except FileNotFoundError:
            pytest.skip("no /proc/PID/task/PID/children on this kernel")
        # The relay is a fork of the wrapper; the child is the one that runs the sleep.
        for pid in children:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"time.sleep(60)" in f.read():
                        return wrapper, pid
            except FileNotFoundError:
                pass
        time.sleep(0.05)
    wrapper.kill()
    raise AssertionError("the wrapper's child did not start within 30 s")


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def marker_after(child_signal: int) -> "re.Match":
    """The wrapper's exit marker when its child died of ``child_signal`` while the wrapper
    was stopped, and the launcher's SIGTERM reached the wrapper after that."""
    wrapper, child = start_wrapper()
    try:
        os.kill(wrapper.pid, signal.SIGSTOP)  # the wrapper cannot wake to its child's end
        os.kill(child, child_signal)
        deadline = time.monotonic() + 10
        while state(child) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(wrapper.pid, signal.SIGTERM)  # the launcher ending the job, signal pending
        os.kill(wrapper.pid, signal.SIGCONT)
        _, err = wrapper.communicate(timeout=30)
    finally:
        wrapper.kill()
    found = MARKER.search(err)
    assert found, err
    return found


def test_a_child_killed_before_the_launchers_signal_is_its_own_failure():
    found = marker_after(signal.SIGKILL)
    # killed by SIGKILL, not ended by the launcher
    assert (found[1], found[3], found[4]) == ("137", " killed", None), found[0]


def test_a_child_that_the_launchers_signal_ended_is_reported_as_ended():
    wrapper, _ = start_wrapper()
    try:
        wrapper.send_signal(signal.SIGTERM)
        _, err = wrapper.communicate(timeout=30)
    finally:
        wrapper.kill()
    found = MARKER.search(err)
    assert found, err
    assert (found[1], found[3], found[4]) == (str(128 + signal.SIGTERM), " killed", " ended"), \
        found[0]


def test_a_child_that_the_launchers_signal_to_the_group_killed_is_reported_as_ended():
    # The launcher signals the wrapper's process group, which the child shares: the child may
    # be dead of that signal before the wrapper's handler runs.
    found = marker_after(signal.SIGTERM)
    assert (found[1], found[4]) == (str(128 + signal.SIGTERM), " ended"), found[0]


def test_a_child_that_exits_on_its_own_is_reported_with_its_code():
    wrapper = subprocess.Popen([sys.executable, "-m", "hvd_trainer_launch.worker", "--",
                                sys.executable, "-c", "raise SystemExit(137)"],
                               env=dict(os.environ, PMI_RANK="3"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _, err = wrapper.communicate(timeout=30)
    found = MARKER.search(err)
    assert found, err
    assert (found[1], found[3], found[4]) == ("137", None, None), found[0]


@pytest.mark.parametrize("ulfm", [False, True])
def test_under_ulfm_the_wrapper_of_a_killed_child_dies_of_the_same_signal(ulfm, monkeypatch):
    """hvdrun --ulfm: Open MPI tells the other ranks at once of a process it started that a
    signal killed, and ends the job when one exits with a code; so the wrapper, once it has
    reported, dies as its child died."""
    if ulfm:
        monkeypatch.setenv("HVD_ULFM", "1")
    wrapper, child = start_wrapper()
    try:
        os.kill(child, signal.SIGKILL)
        _, err = wrapper.communicate(timeout=30)
    finally:
        wrapper.kill()
    found = MARKER.search(err)
    assert found and (found[1], found[3]) == ("137", " killed"), err
    assert wrapper.returncode == (-signal.SIGKILL if ulfm else 137)
