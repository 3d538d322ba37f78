"""The rank wrapper (hvd_trainer_launch.rank.wrapper) run directly, without MPI: how it reports its
child's exit to hvdrun's report port. A child that ended before the launcher's SIGTERM reached the wrapper
failed on its own; one that the SIGTERM ended was ended by the launcher (issue 22: after a
remote kill -9, Open MPI signalled every rank, the killed one's wrapper included, before that
wrapper had woken to its child's end, and hvdrun named a survivor)."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hvd_trainer_launch import protocol
from hvd_trainer_launch.job import reports
from hvd_trainer_launch.protocol import Exited, Started
from hvd_trainer_launch.rank import wrapper

SECRET = "the job's secret"
_received = []


@pytest.fixture(autouse=True)
def report_port(monkeypatch):
    """hvdrun's report port for the wrappers of a test (their environment names it)."""
    _received.clear()
    server = reports.serve(SECRET.encode(), [("localhost", 4)], None, _received.append)
    monkeypatch.setenv(protocol.REPORTS_VARIABLE, server.address)
    monkeypatch.setenv(protocol.SECRET_VARIABLE, SECRET)
    yield
    server.close()


def exit_report() -> Exited:
    """The one exit report that rank 3's wrapper sent, after its start report."""
    assert _received[0] == Started(3, os.uname().nodename), _received
    exits = _received[1:]
    assert len(exits) == 1 and exits[0].rank == 3, _received
    return exits[0]


def start_wrapper():
    """The wrapper as rank 3 around a child that sleeps; returns it and the child's pid once the
    child runs."""
    env = dict(os.environ, PMI_RANK="3")
    wrapper = subprocess.Popen([sys.executable, "-m", "hvd_trainer_launch.rank.wrapper", "--",
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


def report_after(child_signal: int) -> Exited:
    """The wrapper's exit report when its child died of ``child_signal`` while the wrapper
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
        wrapper.communicate(timeout=30)
    finally:
        wrapper.kill()
    return exit_report()


def test_a_child_killed_before_the_launchers_signal_is_its_own_failure():
    found = report_after(signal.SIGKILL)
    # killed by SIGKILL, not ended by the launcher
    assert (found.code, found.killed, found.ended) == (137, True, False), found


def test_a_child_that_the_launchers_signal_ended_is_reported_as_ended():
    wrapper, _ = start_wrapper()
    try:
        wrapper.send_signal(signal.SIGTERM)
        wrapper.communicate(timeout=30)
    finally:
        wrapper.kill()
    found = exit_report()
    assert (found.code, found.killed, found.ended) == (128 + signal.SIGTERM, True, True), found


def test_a_child_that_the_launchers_signal_to_the_group_killed_is_reported_as_ended():
    # The launcher signals the wrapper's process group, which the child shares: the child may
    # be dead of that signal before the wrapper's handler runs.
    found = report_after(signal.SIGTERM)
    assert (found.code, found.ended) == (128 + signal.SIGTERM, True), found


def test_a_child_that_exits_on_its_own_is_reported_with_its_code():
    wrapper = subprocess.Popen([sys.executable, "-m", "hvd_trainer_launch.rank.wrapper", "--",
                                sys.executable, "-c", "raise SystemExit(137)"],
                               env=dict(os.environ, PMI_RANK="3"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wrapper.communicate(timeout=30)
    found = exit_report()
    assert (found.code, found.killed, found.ended) == (137, False, False), found


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
        wrapper.communicate(timeout=30)
    finally:
        wrapper.kill()
    found = exit_report()
    assert (found.code, found.killed) == (137, True), found
    assert wrapper.returncode == (-signal.SIGKILL if ulfm else 137)


def test_the_wrapper_writes_long_lines_in_pieces_that_fit_one_pipe_write():
    code = "import sys; sys.stdout.write('x' * 10000 + '\\nshort\\n' + 'y' * 70000)"
    wrapper = subprocess.run([sys.executable, "-m", "hvd_trainer_launch.rank.wrapper", "--",
                              sys.executable, "-c", code], env=dict(os.environ, PMI_RANK="3"),
                             capture_output=True, timeout=30)
    assert wrapper.returncode == 0, wrapper.stderr
    lines = wrapper.stdout.split(b"\n")[:-1]
    assert all(len(line) + 1 <= protocol.PIECE_BYTES for line in lines)
    joined, line = [], b""
    for piece in lines:
        line += piece[len(b"[3]<stdout>:"):]
        if piece.startswith(b"[3]<stdout>:"):
            joined.append(line)
            line = b""
        else:
            assert piece.startswith(b"[3]<stdout>+")
    # a line without its newline is passed on at protocol.MAX_LINE bytes, the rest at the end
    assert joined == [b"x" * 10000, b"short", b"y" * protocol.MAX_LINE,
                      b"y" * (70000 - protocol.MAX_LINE)]


def test_a_wrapper_that_cannot_reach_hvdrun_says_so_and_runs_the_rank(monkeypatch):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv(protocol.REPORTS_VARIABLE, f"127.0.0.1:{closed.getsockname()[1]}")
    wrapper = subprocess.run([sys.executable, "-m", "hvd_trainer_launch.rank.wrapper", "--",
                              sys.executable, "-c", "print('ran')"],
                             env=dict(os.environ, PMI_RANK="3"), capture_output=True, text=True,
                             timeout=30)
    assert wrapper.returncode == 0 and wrapper.stdout == "[3]<stdout>:ran\n"
    assert wrapper.stderr.startswith("[3]<stderr>:hvdrun: warning: rank 3 cannot report to hvdrun at 127.0.0.1:")


def test_the_wrapper_ends_its_rank_when_the_engine_agent_that_started_it_is_gone(monkeypatch):
    """An elastic engine job under --ulfm keeps the MPI daemon past a lost agent; the rank's
    wrapper ends the rank itself (as if killed: the other ranks go on without it)."""
    from hvd_trainer_launch.processes import identity, still_there
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    named = identity(agent.pid)
    assert still_there(named)
    monkeypatch.setenv(protocol.ENGINE_AGENT_VARIABLE, named)
    wrapper, _ = start_wrapper()
    agent.kill()
    agent.wait()
    assert not still_there(named)
    wrapper.communicate(timeout=30)  # the child sleeps for 60 s unless it is ended
    report = exit_report()
    assert (report.code, report.killed, report.ended) == (128 + signal.SIGTERM, True, False)


@pytest.mark.parametrize("env, cores, share", [
    ({"HOROVOD_LOCAL_SIZE": "2"}, 2, "1"),
    ({"HOROVOD_LOCAL_SIZE": "2"}, 16, "8"),
    ({"HOROVOD_LOCAL_SIZE": "3"}, 2, "1"),  # never 0: OpenBLAS would take every core
    ({"MPI_LOCALNRANKS": "4"}, 8, "2"),  # the launcher's count, where hvdrun gave no hosts
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 6, "3"),
    ({"HOROVOD_LOCAL_SIZE": "1"}, 8, None),  # alone on its host: OpenBLAS's own default
    ({}, 8, None),
    ({"HOROVOD_LOCAL_SIZE": "2", "OMP_NUM_THREADS": "4"}, 8, None),  # the user's choice
    ({"HOROVOD_LOCAL_SIZE": "2", "OPENBLAS_NUM_THREADS": "1"}, 8, None),
])
def test_ranks_on_one_host_share_its_cores_for_openblas(env, cores, share):
    expected = {} if share is None else {"OPENBLAS_NUM_THREADS": share}
    assert wrapper.blas_share(env, cores) == expected
