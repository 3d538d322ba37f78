"""hvd_trainer.ray across the test bed: a Ray head on h1 and a Ray node on h2 and h3, each
started with ``ray start --block`` inside its host and ended by PID (every process in that
host's PID namespace but its first), never by ``ray stop``. The driver runs on h1; ranks on
other hosts are started by the agents there, with no ssh. Checked: the layout by host
(local and cross ranks), data across the link against NumPy, and a rank on h3 that raises."""
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest

HEAD = "10.213.0.1"
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

    ray.init(address=sys.argv[1], log_to_driver=False)
    deadline = time.monotonic() + 120
    while sum(node["Alive"] for node in ray.nodes()) < 3:
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.5)
    settings = RayExecutor.create_settings(timeout_s=60)
    packed = RayExecutor(settings, num_workers=3)
    packed.start()
    print("PACKED", json.dumps(packed.run(place, args=[int(sys.argv[2])])), flush=True)
    packed.shutdown()
    spread = RayExecutor(settings, num_hosts=3, num_workers_per_host=1)
    spread.start()
    try:
        spread.run(raise_on_h3)
    except Exception as error:
        print("RAISED", json.dumps(str(error)), flush=True)
    spread.shutdown()
""")


def _namespace_processes(bed, host):
    """PIDs (as this machine sees them) in ``host``'s PID namespace, but its first process."""
    init = bed._host(host)["init"]
    space = os.readlink(f"/proc/{init}/ns/pid_for_children")
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != init:
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == space:
                    found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def ray_bed(bed):
    """Ray daemons on h1 (head), h2 and h3; stopped by PID at the end."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed here; pip install -e '.[test]'")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **_TOKEN)
    daemons = []
    try:
        for host in bed.hosts:
            role = (["--head", f"--port={PORT}", "--include-dashboard=false"] if host == "h1"
                    else [f"--address={HEAD}:{PORT}"])
            log = open(os.path.join(bed.shared, f"ray-{host}.log"), "wb")
            daemons.append(bed.popen(host, [ray_cli, "start", "--block", *role,
                                            f"--node-ip-address={bed.address(host)}",
                                            f"--num-cpus={CPUS[host]}", "--disable-usage-stats"],
                                     cwd=bed.shared, env=env, stdout=log, stderr=log,
                                     start_new_session=True))
            if host == "h1":
                time.sleep(5)  # the head's GCS first
        yield f"{HEAD}:{PORT}"
    finally:
        for host in bed.hosts:
            for pid in _namespace_processes(bed, host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for daemon in daemons:
            daemon.wait(30)


@pytest.fixture(scope="module")
def driver(bed, ray_bed):
    """One driver run on h1: its PACKED results and RAISED message."""
    before = bed.link_bytes("h2")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **_TOKEN)
    done = bed.run("h1", [sys.executable, "-c", _DRIVER, ray_bed, str(PAYLOAD)], cwd=bed.shared,
                   env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
             for line in done.stdout.splitlines() if line.startswith(("PACKED ", "RAISED "))}
    return lines, bed.link_bytes("h2") - before


def test_packed_layout_by_host(driver):
    results = driver[0]["PACKED"]
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
    results, moved = driver[0]["PACKED"], driver[1]
    if "h2" in {r["host"] for r in results}:
        assert moved >= PAYLOAD
    else:
        pytest.skip("Ray packed the ranks onto h1 and h3")


def test_rank_on_h3_raises_named(driver):
    assert "raised on rank 2 on host h3" in driver[0]["RAISED"]
    assert "the rank on h3 fails" in driver[0]["RAISED"]
