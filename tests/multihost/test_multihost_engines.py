"""hvd_trainer.ray across the test bed: a Ray head on h1 and a Ray node on h2 and h3, each
started with ``ray start --block`` inside its host and ended by PID (every process whose
environment carries the fixture's marker), never by ``ray stop``, with Ray's token
authentication on (a driver without the token is refused). The driver runs on h1 and imports
hvd_trainer alone; ranks on other hosts are started by the agents there, with no ssh. Checked:
the layout by host (local and cross ranks), data across the link against NumPy, a Ray Train
loop that imports horovod.torch against one process, a rank on h3 that raises, a killed agent
(Ray's actor, named with Ray's words) on h3 and Ctrl-C on the driver, with nothing left on
any host. hvd_trainer.spark's are in test_multihost_spark.py."""
import importlib.util
import os
import re
import secrets
import subprocess
import sys
import textwrap
from typing import Dict, List, NamedTuple, Tuple

import pytest

import multihost
import torch_loops

HEAD = multihost.HEAD
PORT = 6379
CPUS = {"h1": 2, "h2": 1, "h3": 1}
# Ray 2.60 authenticates to its GCS with a token: one for the bed's cluster, in every process's
# environment (the hosts' home folders differ, so ~/.ray/auth_token would not be shared).
_TOKEN = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
PAYLOAD = 8 << 20  # bytes in the allreduce: at least that much must cross h2's link

_DRIVER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import ray
    from hvd_trainer.ray import RayExecutor

    def place(size):
        import os, socket
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        data = np.full(size // 8, float(hvd.rank() + 1))
        total = hvd.allreduce(data, op=hvd.Sum)
        return {"host": socket.gethostname(), "rank": hvd.rank(), "size": hvd.size(),
                "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                "env_host": os.environ["HOROVOD_HOSTNAME"], "sum": [float(total.min()),
                float(total.max())]}

    def raise_on_h3():
        import socket
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        if socket.gethostname() == "h3":
            raise RuntimeError("the rank on h3 fails")
        hvd.allreduce(np.ones(4))

    def sleep_long(folder):
        import os, time
        import hvd_trainer as hvd
        hvd.init()
        open(os.path.join(folder, f"asleep.{hvd.rank()}"), "w").close()
        time.sleep(120)

    def when_asleep(folder, action):  # on a thread, once every rank of sleep_long sleeps
        import glob, os, threading
        for name in glob.glob(os.path.join(folder, "asleep.*")):
            os.remove(name)
        def watch():
            while len(glob.glob(os.path.join(folder, "asleep.*"))) < 3:
                time.sleep(0.2)
            action()
        threading.Thread(target=watch, daemon=True).start()

    ray.init(address=sys.argv[1], log_to_driver=False)
    deadline = time.monotonic() + 120
    while sum(node["Alive"] for node in ray.nodes()) < 3:
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.5)
    settings = RayExecutor.create_settings(timeout_s=60)
    packed = RayExecutor(settings, num_workers=3)
    packed.start()
    print("PACKED", json.dumps(packed.run(place, args=[int(sys.argv[2])])), flush=True)
    import torch_loops  # a Ray Train loop that imports horovod.torch, moved to RayExecutor
    trained = packed.run(torch_loops.train_func, args=[{"steps": 3}])
    print("TORCH", json.dumps([[w.tolist() for w in rank] for rank in trained]), flush=True)
    packed.shutdown()
    spread = RayExecutor(settings, num_hosts=3, num_workers_per_host=1)
    spread.start()
    try:
        spread.run(raise_on_h3)
    except Exception as error:
        print("RAISED", json.dumps(str(error)), flush=True)
    # A killed agent: h3's actor, while the ranks sleep.
    h3 = [host for host, _ in spread._layout].index("h3")
    when_asleep(sys.argv[3], lambda: ray.kill(spread._agents[h3]))
    try:
        spread.run(sleep_long, args=[sys.argv[3]])
    except Exception as error:
        print("KILLED", json.dumps(str(error)), flush=True)
    spread.shutdown()
    # Ctrl-C on the driver while the ranks sleep: the job ends, the driver with it.
    spread.start()
    import os, signal
    when_asleep(sys.argv[3], lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        spread.run(sleep_long, args=[sys.argv[3]])
    except KeyboardInterrupt:
        print("INTERRUPTED", json.dumps(None), flush=True)
""")


@pytest.fixture(scope="module")
def ray_bed(bed):
    """Ray daemons on h1 (head), h2 and h3; stopped by PID at the end."""
    ray_cli, marker, env = multihost.ray_daemons("HVD_TEST_RAY_BED", _TOKEN)
    daemons = []
    try:
        for host in bed.hosts:
            # Nothing the tests do not use: no dashboard, autoscaler monitor or log monitor
            # (the driver does not print the workers' output).
            role = (["--head", f"--port={PORT}", "--include-dashboard=false", "--no-monitor"]
                    if host == "h1" else [f"--address={HEAD}:{PORT}"])
            log = open(os.path.join(bed.shared, f"ray-{host}.log"), "wb")
            daemons.append(bed.popen(host, [ray_cli, "start", "--block", *role,
                                            f"--node-ip-address={bed.address(host)}",
                                            f"--num-cpus={CPUS[host]}", "--disable-usage-stats",
                                            "--include-log-monitor=false"],
                                     cwd=bed.shared, env=env, stdout=log, stderr=log,
                                     start_new_session=True))
            if host == "h1":  # the head's GCS first: the nodes join it at once
                multihost.wait_for_text(os.path.join(bed.shared, "ray-h1.log"),
                                        "Ray runtime started", 90)
        yield f"{HEAD}:{PORT}"
    finally:
        multihost.stop_processes_with(marker)
        for daemon in daemons:
            daemon.wait(30)


class RayRun(NamedTuple):
    """What the driver's run on h1 gave."""

    said: Dict[str, object]  # its PACKED and TORCH results, RAISED, KILLED, INTERRUPTED
    moved: Dict[str, int]  # the bytes each other host's link carried meanwhile
    left: Dict[str, List[str]]  # the job processes left on each host after it
    refused: Tuple[str, int]  # a driver without the token, run meanwhile: its stderr and code


@pytest.fixture(scope="module")
def driver(bed, ray_bed) -> RayRun:
    """One driver run on h1, and a driver without the cluster's token meanwhile."""
    before = {host: bed.link_bytes(host) for host in ("h2", "h3")}
    tokenless = bed.popen("h1", [sys.executable, "-c", f"import ray; ray.init(address={ray_bed!r})"],
                          cwd=bed.shared, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env={k: v for k, v in os.environ.items()
                                          if not k.startswith("RAY_AUTH")})
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=multihost.TESTS, **_TOKEN)
    done = bed.run("h1", [sys.executable, "-c", _DRIVER, ray_bed, str(PAYLOAD), bed.shared],
                   cwd=bed.shared, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    said = multihost.driver_said(done.stdout, "PACKED", "TORCH", "RAISED", "KILLED",
                                 "INTERRUPTED")
    moved = {host: bed.link_bytes(host) - count for host, count in before.items()}
    refused = tokenless.communicate(timeout=120)[1], tokenless.returncode
    return RayRun(said, moved, multihost.wait_until_no_job_is_left(bed), refused)


def test_packed_layout_by_host(driver):
    results = driver.said["PACKED"]
    hosts = [r["host"] for r in results]
    # Ranks on one host are consecutive; local and cross ranks follow the hosts.
    order = list(dict.fromkeys(hosts))
    assert hosts == sorted(hosts, key=order.index) and len(order) == 2
    for r in results:
        same = [x for x in results if x["host"] == r["host"]]
        assert r["local_size"] == len(same)
        assert r["local_rank"] == [x["rank"] for x in same].index(r["rank"])
        assert r["env_host"] == r["host"] and r["size"] == 3
    # The Sum of 1, 2, 3 in every element (NumPy's answer for the rows the ranks made).
    assert all(r["sum"] == [6.0, 6.0] for r in results)


def test_data_crosses_the_link(driver):
    results, moved = driver.said["PACKED"], driver.moved
    other = next(r["host"] for r in results if r["host"] != "h1")  # Ray packs h1 and one more
    assert moved[other] >= PAYLOAD


def test_killed_agent_on_h3_is_named_and_leaves_nothing(driver):
    assert "the agent on h3 was lost" in driver.said["KILLED"]
    assert re.search(r"\nh3: ActorDiedError: .*ray\.kill", driver.said["KILLED"])  # Ray's words
    assert driver.left == {}  # no rank, wrapper or proxy on any host (their own ps)


def test_a_ray_train_loop_importing_horovod_torch_equals_one_process(driver):
    # Issue 46: the driver imports hvd_trainer alone (nothing named horovod can be imported
    # here); each rank, on whichever host, gets the shim by itself.
    assert importlib.util.find_spec("horovod") is None
    reference = torch_loops.one_process(3)
    assert len(driver.said["TORCH"]) == 3
    for weights in driver.said["TORCH"]:
        multihost.assert_weights_close(weights, reference)


def test_the_cluster_runs_with_token_authentication_on(driver):
    # The driver above held the token; one without it was refused (Ray 2.60's default).
    stderr, code = driver.refused
    assert code != 0 and "AuthenticationError" in stderr, stderr[-2000:]


def test_ctrl_c_on_the_driver_ends_the_job(driver):
    assert "INTERRUPTED" in driver.said


def test_rank_on_h3_raises_named(driver):
    # STRICT_SPREAD's bundles reach the nodes in Ray's order: h3's rank is any of them.
    assert re.search(r"raised on rank \d on host h3", driver.said["RAISED"])
    assert "the rank on h3 fails" in driver.said["RAISED"]
