"""hvd_trainer.ray's elastic RayExecutor (min_workers, max_workers, cooldown_range: the
ElasticRayExecutor underneath) across the test bed: a Ray head on h1 and a Ray node on
h2 and h3 (one CPU each, so one slot each: Ray's own discovery, RayHostDiscovery), started
with ``ray start --block`` inside its host and ended by PID, never by ``ray stop``. The driver
on h1 trains tests/elastic_loops.py's job on the three hosts; h3's raylet is SIGKILLed
mid-training (its actor, proxy and rank die with it), the job goes on from its last commit on
h1 and h2, h3's Ray node is started again, and the job grows back onto it. Checked: the final
weights equal the committed steps replayed in one process, the life after the loss starts at
or after the last commit seen before it (no commit lost), every rank ends with the same
weights, and nothing of the job is left on any host. Under MPICH (Open MPI's pass does not
run the engine tests)."""
import os
import secrets
import subprocess
import sys
import textwrap

import numpy as np

import elastic_loops
import multihost

HEAD = multihost.HEAD
PORT = 6380
# The job ends elastic_loops.GROWN_STEPS steps after it grows back; LIMIT bounds it when it
# does not. PAUSE: seconds between steps, the pace of the job while h3 is lost and returns.
LIMIT = 400
PAUSE = 0.5
TOKEN = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}

_DRIVER = textwrap.dedent("""
    import json, sys, time
    import ray
    import elastic_loops
    from hvd_trainer.ray import RayExecutor
    ray.init(address=sys.argv[1], log_to_driver=False)
    deadline = time.monotonic() + 120
    while sum(node["Alive"] for node in ray.nodes()) < 3:
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.5)
    # RayExecutor's elastic form. Until Ray marks h3's node dead, a life may still start
    # there and fail: a host failing in two lives in a row stays out for the cooldown.
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2,
                           max_workers=3, cooldown_range=(1, 3), elastic_timeout=120,
                           cpus_per_worker=1)
    executor.start()
    results = executor.run(elastic_loops.train, args=(int(sys.argv[3]), sys.argv[2],
                                                        float(sys.argv[4])))
    print("RESULTS", json.dumps([[w.tolist(), sizes] for w, sizes in results]), flush=True)
""")

# Finds h3's raylet (in h3's PID namespace: the bed runs this there) by the fixture's marker.
KILL_RAYLET = textwrap.dedent("""
    import os, signal, sys
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                mine = sys.argv[1].encode() in environ.read().split(b"\\0")
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                raylet = os.path.basename(cmdline.read().split(b"\\0")[0]) == b"raylet"
        except OSError:
            continue
        if mine and raylet:
            os.kill(int(entry), signal.SIGKILL)
            print("killed", entry)
""")


def ray_node(bed, host, env, ray_cli):
    """``ray start --block`` on ``host`` (the head on h1), one CPU; its log in the shared
    folder."""
    role = (["--head", f"--port={PORT}", "--include-dashboard=false", "--no-monitor"]
            if host == "h1" else [f"--address={HEAD}:{PORT}"])
    log = open(os.path.join(bed.shared, f"ray-elastic-{host}.log"), "ab")
    return bed.popen(host, [ray_cli, "start", "--block", *role,
                            f"--node-ip-address={bed.address(host)}", "--num-cpus=1",
                            "--disable-usage-stats", "--include-log-monitor=false"],
                     cwd=bed.shared, env=env, stdout=log, stderr=log, start_new_session=True)


def start_cluster(bed, env, ray_cli, daemons):
    """The Ray head on h1, then a node on h2 and on h3; each daemon appended to ``daemons``."""
    daemons.append(ray_node(bed, "h1", env, ray_cli))
    multihost.wait_for_text(os.path.join(bed.shared, "ray-elastic-h1.log"),
                            "Ray runtime started", 90)
    daemons.extend(ray_node(bed, host, env, ray_cli) for host in ("h2", "h3"))


def end_all(driver, marker, daemons):
    """End the driver if it still runs, then the Ray daemons (by PID) and what they started."""
    if driver is not None and driver.poll() is None:
        driver.kill()
        driver.communicate()
    multihost.stop_processes_with(marker)
    for daemon in daemons:
        daemon.wait(30)


def test_raylet_killed_on_h3_shrinks_and_its_return_grows_with_no_commit_lost(bed):
    ray_cli, marker, env = multihost.ray_daemons("HVD_TEST_RAY_ELASTIC_BED", TOKEN)
    progress = os.path.join(bed.shared, f"ray-elastic-{secrets.token_hex(4)}")
    daemons, driver = [], None
    try:
        start_cluster(bed, env, ray_cli, daemons)
        driver = bed.popen("h1", [sys.executable, "-c", _DRIVER, f"{HEAD}:{PORT}", progress,
                                  str(LIMIT), str(PAUSE)],
                           cwd=bed.shared, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=dict(env, OMP_NUM_THREADS="1",
                                               PYTHONPATH=multihost.TESTS))
        elastic_loops.wait(lambda: elastic_loops.commits_on_three(progress) >= 4, 300)
        seen = int(elastic_loops.notes(progress, "commit")[-1][0])
        killed = bed.run("h3", [sys.executable, "-c", KILL_RAYLET, marker],
                         capture_output=True, text=True, timeout=60)
        assert "killed" in killed.stdout, killed.stderr
        elastic_loops.wait(lambda: any(size == "2" for _, size in
                                       elastic_loops.notes(progress, "start")), 300)
        daemons.append(ray_node(bed, "h3", env, ray_cli))  # h3 comes back
        out, err = driver.communicate(timeout=600)
        assert driver.returncode == 0, err[-4000:]
    finally:
        end_all(driver, marker, daemons)
    results = multihost.driver_said(out, "RESULTS")["RESULTS"]
    said = "\n".join(line for line in err.splitlines() if line.startswith("hvdrun"))
    assert len(results) == 3, f"not grown back to h3; hvdrun said:\n{said}"
    elastic_loops.check([(np.array(w), sizes) for w, sizes in results], progress, seen,
                        grew_in_place=True)
    assert multihost.wait_until_no_job_is_left(bed) == {}
