"""The Spark driver's registry (hvd_trainer_launch.engines.registry) over real sockets: tasks
register and get their own assignment, ranks report, and nobody without the job's secret
registers, reports, or passes off an answer; plus the driver's pieces beside it: the
assignments by host in local rank order, get_available_devices, and Spark's failures in words."""
import hmac
import json
import os
import re
import socket
import threading

import pytest

from hvd_trainer_launch.engines import spark_causes as causes, spark_run as runner
from hvd_trainer.spark import task
from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import registry as engine_registry
from hvd_trainer_launch.engines.registry import Assignment, Registration

SECRET = os.urandom(32)


def _register_in_thread(address, secret, registration, found):
    def register():
        try:
            found[registration.index] = engine_registry.register(address, secret,
                                                                 registration, 30)
        except (OSError, ValueError) as error:
            found[registration.index] = error
    thread = threading.Thread(target=register)
    thread.start()
    return thread


def test_tasks_register_get_their_own_answer_and_ranks_report():
    registry = engine_registry.Registry("127.0.0.1", SECRET, tasks=2, ranks=3)
    try:
        found = {}
        tasks = [Registration(1, "h2", {"gpu": ["1"]}), Registration(0, "h1", {})]
        threads = [_register_in_thread(registry.address, SECRET, t, found) for t in tasks]
        assert registry.wait_registered(30)
        assert registry.registered() == {0: tasks[1], 1: tasks[0]}
        registry.answer({0: Assignment("proxy --here", {"A": "1"})})
        for thread in threads:
            thread.join(30)
        assert found == {0: Assignment("proxy --here", {"A": "1"}, None), 1: Assignment()}
        for rank in (2, 0, 1, 1):  # a repeat counts once
            engine_registry.report_running(registry.address, SECRET, rank)
        assert registry.wait_running(30) and registry.running() == {0, 1, 2}
    finally:
        registry.close()


def test_a_stranger_without_the_secret_neither_registers_nor_reports():
    registry = engine_registry.Registry("127.0.0.1", SECRET, tasks=1, ranks=1)
    try:
        stranger = os.urandom(32)
        with pytest.raises(OSError):  # the registry hangs up on it
            engine_registry.register(registry.address, stranger, Registration(0, "h", {}), 30)
        with pytest.raises(OSError):
            engine_registry.report_running(registry.address, stranger, 0)
        assert registry.registered() == {} and registry.running() == set()
        # Out of range, a task's second registration: refused; the real task still gets in.
        with pytest.raises(OSError):
            engine_registry.register(registry.address, SECRET, Registration(1, "h", {}), 30)
        found = {}
        thread = _register_in_thread(registry.address, SECRET, Registration(0, "h", {}), found)
        assert registry.wait_registered(30)
        with pytest.raises(OSError):
            engine_registry.register(registry.address, SECRET, Registration(0, "x", {}), 30)
        registry.answer({})
        thread.join(30)
        assert found == {0: Assignment()}
    finally:
        registry.close()


def test_an_answer_not_signed_with_the_secret_is_refused():
    """A fake driver that answers with some other key's signature: the task runs nothing."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def fake_driver():
            conn, _ = server.accept()
            with conn:
                challenge = os.urandom(16)
                conn.sendall(challenge)
                size = int.from_bytes(protocol.receive(conn, 4, None), "big")
                payload = protocol.receive(conn, size + 32, None)[:size]
                answer = json.dumps(Assignment("rm -rf /")._asdict()).encode()
                conn.sendall(len(answer).to_bytes(4, "big") + answer + protocol.mac(
                    os.urandom(32), b"assign", challenge, payload, answer))
        thread = threading.Thread(target=fake_driver)
        thread.start()
        with pytest.raises(ValueError, match="not signed with this job's secret"):
            engine_registry.register(f"127.0.0.1:{server.getsockname()[1]}", SECRET,
                                     Registration(0, "h", {}), 30)
        thread.join(30)


def test_a_replayed_registration_does_not_pass_a_fresh_challenge():
    registry = engine_registry.Registry("127.0.0.1", SECRET, tasks=1, ranks=1)
    try:
        payload = json.dumps({"kind": "register", "index": 0, "host": "h",
                              "resources": {}}).encode()
        with socket.create_connection(registry.address.rsplit(":", 1)) as conn:
            old = protocol.receive(conn, 16, None)
        with socket.create_connection(registry.address.rsplit(":", 1)) as conn:
            fresh = protocol.receive(conn, 16, None)
            assert not hmac.compare_digest(old, fresh)
            conn.sendall(len(payload).to_bytes(4, "big") + payload
                         + protocol.mac(SECRET, b"register", old, payload))
            assert conn.recv(1) == b""  # hung up
        assert registry.registered() == {}
    finally:
        registry.close()


def test_assignments_give_each_hosts_first_task_the_tasks_resources_by_local_rank():
    tasks = {0: Registration(0, "h1", {"gpu": ["3"]}), 1: Registration(1, "h2", {"gpu": ["0"]}),
             2: Registration(2, "h1", {"gpu": ["1"]}), 3: Registration(3, "h2", {})}
    layout = [("h1", 2), ("h2", 2)]  # engine_launch.rank_layout of the hosts in task order
    found = runner._assignments(tasks, layout, ["line-h1", "line-h2"], "driver:1")
    assert sorted(found) == [0, 1]  # tasks 2 and 3 run nothing
    assert found[0].line == "line-h1" and found[1].line == "line-h2"
    # Local rank 0 on h1 is task 0, local rank 1 task 2 (index order, as the layout numbers).
    assert json.loads(found[0].env[task.RESOURCES_VARIABLE]) == [{"gpu": ["3"]}, {"gpu": ["1"]}]
    assert json.loads(found[1].env[task.RESOURCES_VARIABLE]) == [{"gpu": ["0"]}, {}]
    assert found[0].env[engine_registry.VARIABLE] == "driver:1"


def test_get_available_devices_reads_this_local_ranks_entry(monkeypatch):
    monkeypatch.delenv(task.RESOURCES_VARIABLE, raising=False)
    assert task.get_available_devices() == []  # outside a Spark job, as Horovod's
    monkeypatch.setenv(task.RESOURCES_VARIABLE, json.dumps([{"gpu": ["3"]}, {"gpu": ["1", "2"]},
                                                            {}]))
    for local_rank, want in ((0, ["3"]), (1, ["1", "2"]), (2, [])):
        monkeypatch.setenv("HOROVOD_LOCAL_RANK", str(local_rank))
        assert task.get_available_devices() == want


# What Spark 4.3 said (2026-12-06, local-cluster), as the driver's Py4JJavaError text has it.
_HEAD = ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe."
         "\n: org.apache.spark.SparkException: Job aborted due to stage failure: ")
_LOST = ("Could not recover from a failed barrier ResultStage. Most recent failure reason: Stage "
         "failed because barrier task ResultTask(1, 2) finished unsuccessfully.\n"
         "ExecutorLostFailure (executor 0 exited caused by one of the running tasks) Reason: "
         "Command exited with code {code}\n\tat org.apache.spark.scheduler.DAGScheduler...")


@pytest.mark.parametrize("code, meaning", [
    (137, r"killed \(SIGKILL"), (50, "barrier socket .*spark.python.unix.domain.socket.enabled"),
    (52, "ran out of memory .*spark.executor.memory")])
def test_a_lost_executor_is_named_with_its_host_and_what_its_exit_code_means(code, meaning):
    said = causes.explain(_HEAD + _LOST.format(code=code), {2: "h3"})
    assert said.startswith("the executor of task 2 on h3 was lost (executor 0 exited caused by "
                           f"one of the running tasks): Spark says 'Command exited with code "
                           f"{code}'; ")
    assert re.search(meaning, said)


def test_results_over_the_limit_and_an_out_of_memory_task_are_named():
    said = causes.explain(_HEAD + "Total size of serialized results of 2 tasks (6.0 MiB) is "
                          "bigger than spark.driver.maxResultSize (4.0 MiB)", {})
    assert "(6.0 MiB: the ranks' return values) exceed spark.driver.maxResultSize (4.0 MiB)" \
        in said and "'spark.driver.maxResultSize', '4g'" in said
    said = causes.explain(_HEAD + "Could not recover from a failed barrier ResultStage. Most "
                          "recent failure reason: Stage failed because barrier task "
                          "ResultTask(2, 0) finished unsuccessfully.\njava.lang.OutOfMemoryError:"
                          " Java heap space\n\tat java.base/java.util.Arrays.copyOf", {0: "h1"})
    assert said.startswith("task 0 on h1 ran out of memory (java.lang.OutOfMemoryError: "
                           "Java heap space): raise spark.executor.memory")


def test_a_dead_python_worker_is_named_with_its_host():
    # What Spark 4.3 said of a task whose Python worker was SIGKILLed (2026-12-07).
    said = causes.explain(_HEAD + "Could not recover from a failed barrier ResultStage. Most "
                          "recent failure reason: Stage failed because barrier task "
                          "ResultTask(0, 1) finished unsuccessfully.\norg.apache.spark."
                          "SparkException: Python worker exited unexpectedly (crashed). Consider "
                          "setting 'spark.python.worker.faulthandler.enabled' ...\nCaused by: "
                          "java.io.EOFException", {1: "h2"})
    assert said.startswith("the Python worker of task 1 on h2 died: Spark says 'Python worker "
                           "exited unexpectedly (crashed)'; it was killed (SIGKILL")


def test_a_task_imports_no_hvd_trainer_before_it_registers():
    """The barrier task's function travels by value and refers to hvd_trainer_launch alone:
    unpickling it on an executor imports neither hvd_trainer nor NumPy (a second or more)."""
    import cloudpickle
    import subprocess
    import sys
    data = cloudpickle.dumps(runner._task(b"payload", SECRET, "driver:1", 1.0))
    check = ("import pickle, sys\npickle.loads(sys.stdin.buffer.read())\n"
             "print(sorted(m for m in ('hvd_trainer', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", check], input=data, capture_output=True,
                          timeout=120)
    assert done.stdout.decode().strip() == "[]", done.stderr.decode()[-2000:]
