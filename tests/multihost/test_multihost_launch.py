"""hvdrun across the test bed's hosts: placement, ranks, collectives, ssh flags and the NIC.

Each layout is one job (workers/layout_worker.py), checked by several tests:
- ``hosts``: ``-np 4 -H h1:2,h2:2``;
- ``hostfile``: ``--hostfile`` with 3 hosts of 1 slot (an odd size);
- ``ssh``: ``-p 2222 -i KEY --network-interface lan1`` on 2 hosts. Port 2222 takes only
  that key and port 22 only the default one, so the job starts only if both flags reach ssh;
  the data must then cross lan1 alone.
The expected layout (hvd_trainer's rank, local and cross rank and size, and the HOROVOD_*
variables) is Horovod's by-slot placement, computed here from the host list.
"""
import json
import sys
from types import SimpleNamespace

import pytest

from multihost import expected_layout, hvdrun, worker
from testbed import ALT_PORT, LINKS, PORT

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi

PAYLOAD = 16 << 20  # bytes in the worker's allreduce: at least that much must cross a link
QUIET = 1 << 20  # bytes a link may carry when told to carry no data (ssh, start-up, output)

LAYOUTS = {
    "hosts": ([("h1", 2), ("h2", 2)], ["-np", 4, "-H", "h1:2,h2:2"]),
    "hostfile": ([("h1", 1), ("h2", 1), ("h3", 1)], ["-np", 3, "--hostfile", "HOSTFILE"]),
    "ssh": ([("h1", 1), ("h2", 1)], ["-np", 2, "-H", "h1:1,h2:1", "-p", ALT_PORT, "-i", "KEY",
                                     "--network-interface", "lan1"]),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def job(request, bed):
    """One launch of the layout worker: its case, hosts, completed process, per-rank reports,
    the bytes each (host, link) carried and the logins h2's sshds accepted, per port."""
    hosts, args = LAYOUTS[request.param]
    hostfile = f"{bed.shared}/hostfile"
    with open(hostfile, "w") as f:
        f.write("".join(f"{host} slots={slots}\n" for host, slots in hosts))
    args = [hostfile if a == "HOSTFILE" else bed.alt_key if a == "KEY" else a for a in args]
    counters = [(host, link) for host in bed.hosts for link in LINKS]
    before = {key: bed.link_bytes(*key) for key in counters}
    logins = {port: bed.sshd_log("h2", port).count("Accepted publickey") for port in (PORT, ALT_PORT)}
    proc = hvdrun(bed, [*args, sys.executable, worker("layout_worker.py")])
    reports = {}
    for line in proc.stdout.splitlines():
        if "<stdout>:layout " in line:
            report = json.loads(line.split("<stdout>:layout ", 1)[1])
            reports[report["rank"]] = report
    return SimpleNamespace(
        case=request.param, hosts=hosts, proc=proc, reports=reports,
        moved={key: bed.link_bytes(*key) - before[key] for key in counters},
        logins={port: bed.sshd_log("h2", port).count("Accepted publickey") - logins[port]
                for port in logins})


def started(job):
    assert job.proc.returncode == 0, \
        f"{job.case}: exit {job.proc.returncode}\n{job.proc.stdout}\n{job.proc.stderr}"


def test_ranks_run_on_the_hosts_given_in_slot_order(job):
    started(job)
    assert [job.reports[r]["host"] for r in sorted(job.reports)] == \
        [entry["host"] for entry in expected_layout(job.hosts)]


def test_rank_size_local_and_cross_match_the_layout(job):
    started(job)
    keys = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")
    got = [{key: job.reports[r][key] for key in keys} for r in sorted(job.reports)]
    assert got == [{key: entry[key] for key in keys} for entry in expected_layout(job.hosts)]


def test_horovod_variables_match_the_layout(job):
    started(job)
    want = [{f"HOROVOD_{key.upper()}": str(entry[key]) for key in
             ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")}
            for entry in expected_layout(job.hosts)]
    for rank, entry in enumerate(expected_layout(job.hosts)):
        want[rank]["HOROVOD_HOSTNAME"] = entry["host"]
    assert [job.reports[r]["env"] for r in sorted(job.reports)] == want


def test_collectives_match_numpy_across_hosts(job):
    started(job)
    for rank in range(sum(slots for _, slots in job.hosts)):
        assert f"[{rank}]<stdout>:rank {rank}: collectives match NumPy" in job.proc.stdout, \
            job.proc.stdout


def test_the_data_crosses_the_link(job):
    started(job)
    used = [host for host, _ in job.hosts]
    for host in used:
        if job.case == "ssh":  # --network-interface lan1: the data on lan1, nothing big on lan0
            assert job.moved[host, "lan1"] >= PAYLOAD, job.moved
            assert job.moved[host, "lan0"] < QUIET, job.moved
        else:
            assert job.moved[host, "lan0"] + job.moved[host, "lan1"] >= PAYLOAD, job.moved
    for host, link in job.moved:
        if host not in used:
            assert job.moved[host, link] < QUIET, job.moved


def test_the_launch_logs_in_on_the_port_the_flags_name(job):
    started(job)
    port, other = (ALT_PORT, PORT) if job.case == "ssh" else (PORT, ALT_PORT)
    assert job.logins[port] >= 1 and job.logins[other] == 0, job.logins
