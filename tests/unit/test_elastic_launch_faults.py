"""hvdrun's elastic mode under hostile or failing conditions: slow and idle peers on the
notice port, the cleanup and the launcher failing to start (process limit), a discovery
script that hangs; and the rank a failed shrink names."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from hvd_trainer.runtime import runtime
from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.cli import hvdrun
from hvd_trainer_launch.elastic import discovery, driver as elastic, notices
from hvd_trainer_launch.job import watch as job

SECRET = b"0123456789abcdef0123456789abcdef"


def test_slow_and_idle_peers_on_the_notice_port_hold_up_no_proper_question():
    generation = notices.Generation(SECRET)
    generation.number = 3
    stop = threading.Event()
    idle = []

    def slowloris():  # a byte every half second, for up to 60 s: 48 bytes take 24 s
        with socket.create_connection(("127.0.0.1", generation.port), timeout=60) as conn:
            for _ in range(120):
                if stop.wait(0.5):
                    return
                try:
                    conn.sendall(b"x")
                except OSError:  # the port gave up on us: as it should
                    return

    slow = [threading.Thread(target=slowloris, daemon=True) for _ in range(3)]
    try:
        for thread in slow:
            thread.start()
        for _ in range(300):  # more than the old backlog of 16, fewer than our descriptors
            idle.append(socket.create_connection(("127.0.0.1", generation.port), timeout=10))
        time.sleep(0.5)  # let the slow peers hold the port
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", generation.port), timeout=10) as conn:
                # Within 10 s, though each slow peer would take 24 s to finish its question.
                assert protocol.ask_notice(conn, SECRET, 7, time.monotonic() + 10).number == 3
        assert generation.committed == 7
        assert any(thread.is_alive() for thread in slow)  # they were still trickling
    finally:
        stop.set()
        for conn in idle:
            conn.close()
        generation.close()
        for thread in slow:
            thread.join(10)


def test_a_question_that_does_not_prove_the_secret_is_not_heard():
    generation = notices.Generation(SECRET)
    try:
        with socket.create_connection(("127.0.0.1", generation.port), timeout=10) as conn:
            with pytest.raises(ConnectionError):
                protocol.ask_notice(conn, b"a guess", 9, time.monotonic() + 10)
        assert generation.committed == 0
    finally:
        generation.close()


class FailingPopen:
    """subprocess.Popen for the cleanup: every third start fails as under a process limit;
    the others run for a moment. Counts how many run at once."""
    running = peak = started = 0
    lock = threading.Lock()

    def __init__(self, command, **kwargs):
        with FailingPopen.lock:
            FailingPopen.started += 1
            if FailingPopen.started % 3 == 0:
                raise BlockingIOError(11, "Resource temporarily unavailable")
            FailingPopen.running += 1
            FailingPopen.peak = max(FailingPopen.peak, FailingPopen.running)
        self.pid, self.returncode, self.ends = 0, None, time.monotonic() + 0.05

    def poll(self):
        if self.returncode is None and time.monotonic() >= self.ends:
            self.returncode = 0
            with FailingPopen.lock:
                FailingPopen.running -= 1
        return self.returncode


def test_the_cleanup_of_many_hosts_runs_a_few_at_a_time_and_survives_failed_starts(
        monkeypatch, capsys):
    monkeypatch.setattr(elastic.subprocess, "Popen", FailingPopen)
    hosts = [f"unreachable-{i}" for i in range(60)]
    launcher = mpi.Launcher("/usr/bin/mpiexec", mpi.HYDRA)
    elastic._remove_elsewhere(launcher, [], {}, hosts, ["/dev/shm/hvd_elastic.x"])
    assert FailingPopen.started == 60
    assert 1 <= FailingPopen.peak <= elastic.REMOVE_AT_ONCE
    warning = capsys.readouterr().err
    assert "could not remove the job's commit folders /dev/shm/hvd_elastic.x on" in warning
    assert warning.count("Resource temporarily unavailable") == 20  # each failed start named
    assert "unreachable-2 (Resource temporarily unavailable)" in warning


def test_lives_whose_launch_fails_back_off_exponentially_up_to_a_cap(monkeypatch, capsys):
    def cannot_fork(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    waits = []
    # time.sleep is the one function of the time module every thread shares; other threads of
    # this process (a Ray driver's, left by the engine tests) keep sleeping for real, or their
    # loops would spin and fill ``waits``.
    this_thread, sleep = threading.get_ident(), time.sleep

    def backoff_sleep(seconds):
        if threading.get_ident() == this_thread:
            waits.append(seconds)
        else:
            sleep(seconds)

    monkeypatch.setattr(job, "run_job", cannot_fork)
    monkeypatch.setattr(elastic.time, "sleep", backoff_sleep)
    parser = hvdrun.build_parser()
    args = hvdrun.parse_arguments(parser, ["--min-np", "1", "--reset-limit", "7",
                                           "--blacklist-cooldown-range", "0", "0",
                                           "python", "train.py"])
    launcher = mpi.Launcher("/usr/bin/mpiexec", mpi.HYDRA)
    assert elastic.run(args, launcher, [], ["python", "train.py"], []) == 1
    assert waits == [1, 2, 4, 8, 16, 30, 30]
    err = capsys.readouterr().err
    assert "could not start /usr/bin/mpiexec: [Errno 11] Resource temporarily unavailable" in err
    assert "no rank started in this life; waiting 16 s before the next" in err
    assert "over --reset-limit 7" in err
    assert [elastic.launch_backoff(n) for n in (0, 1, 2, 6, 100)] == [0, 1, 2, 30, 30]


@pytest.fixture
def hanging_script(tmp_path):
    """A discovery script whose child hangs (and keeps its output open); yields the script
    and the file where it writes that child's pid; kills the child if it is left."""
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    script.chmod(0o755)
    yield str(script), pid_file
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ends(pid: int, seconds: float = 10) -> bool:
    """Whether ``pid`` has ended within ``seconds``: a SIGKILLed process that is not our child
    can still be running when the kill returns, for longer on a busy machine."""
    deadline = time.monotonic() + seconds
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


def discover_in_thread(discovery):
    outcome = []

    def ask():
        try:
            outcome.append(discovery.hosts())
        except ValueError as error:
            outcome.append(error)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, outcome


def test_a_hanging_discovery_script_is_killed_with_its_child_at_the_timeout(hanging_script,
                                                                            monkeypatch):
    script, pid_file = hanging_script
    monkeypatch.setattr(discovery, "DISCOVERY_TIMEOUT", 1.0)
    thread, outcome = discover_in_thread(discovery.Discovery(script, [], None))
    thread.join(30)
    assert not thread.is_alive(), "the discovery did not return after its timeout"
    assert ends(int(pid_file.read_text())), "the script's child is left running"
    assert "did not finish within 1 s" in str(outcome[0])


def test_stopping_the_host_watch_kills_a_discovery_under_way_with_its_child(hanging_script):
    script, pid_file = hanging_script
    running_discovery = discovery.Discovery(script, [], None)
    thread, _ = discover_in_thread(running_discovery)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the discovery script did not start"
        time.sleep(0.05)
    running_discovery.stop()  # what HostWatcher.stop() does when a life ends or hvdrun leaves
    thread.join(30)
    assert not thread.is_alive()
    assert ends(int(pid_file.read_text()))


def test_a_stop_as_the_discovery_script_starts_kills_it(hanging_script, monkeypatch):
    # The race a loaded CI run lost: stop() came after the script had started (its child had
    # written its pid) but before the discovery had recorded the run, so nothing was killed
    # and the run lasted until DISCOVERY_TIMEOUT. Here stop() is called right then, every time.
    script, _ = hanging_script
    running_discovery = discovery.Discovery(script, [], None)
    monkeypatch.setattr(discovery, "DISCOVERY_TIMEOUT", 20.0)
    real_popen = subprocess.Popen

    def popen_then_stop(*args, **kwargs):
        process = real_popen(*args, **kwargs)
        stopper = threading.Thread(target=running_discovery.stop, daemon=True)
        stopper.start()
        stopper.join(0.5)  # stop() returns at once, or waits for the run to be recorded
        return process

    monkeypatch.setattr(discovery.subprocess, "Popen", popen_then_stop)
    with pytest.raises(ValueError, match="was killed by signal 9"):
        running_discovery.hosts()


def test_a_failed_shrink_names_the_rank_it_was():
    runtime.init()
    try:
        assert runtime._rank_now() == 0
    finally:
        runtime.shutdown()  # as a failed shrink leaves it
    assert runtime._rank_now() == 0  # not "?"
