"""The test bed itself: hosts apart from each other and from us, ssh by key only, teardown.

The separation checked here is what keeps MPI from taking a shortcut between "hosts": a file
in one host's /dev/shm or /tmp must not show in another's, nor a process in its process list.
"""
import os
import shutil
import subprocess
import time

import testbed


def run(bed, host, command):
    """Run a shell command in ``host``; its stdout, stripped."""
    proc = bed.run(host, ["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_each_host_has_its_own_name_processes_and_scratch(bed):
    assert [run(bed, host, "hostname") for host in bed.hosts] == ["h1", "h2", "h3"]
    marker = f"hvd-testbed-{os.getpid()}"
    run(bed, "h1", f"touch /dev/shm/{marker} /tmp/{marker}")
    assert run(bed, "h2", f"ls /dev/shm /tmp | grep -c {marker} || true") == "0"
    assert not os.path.exists(f"/dev/shm/{marker}") and not os.path.exists(f"/tmp/{marker}")
    sleeper = bed.popen("h1", ["sleep", "60"])
    try:
        # popen returns once nsenter runs; its child may still be between fork and exec,
        # listed as "[sleep]" with no arguments yet.
        deadline = time.monotonic() + 30
        while run(bed, "h1", "ps -eo args").count("sleep 60") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run(bed, "h1", "ps -eo args").count("sleep 60") == 1
        assert "sleep 60" not in run(bed, "h2", "ps -eo args")
    finally:
        sleeper.kill()
        sleeper.wait()


def test_hosts_reach_each_other_by_name_over_ssh_with_the_bed_key_only(bed):
    assert run(bed, "h1", "ssh h3 hostname") == "h3"
    assert run(bed, "h2", f"ssh -p {testbed.ALT_PORT} -i {bed.alt_key} h1 hostname") == "h1"
    for wrong in (f"ssh -p {testbed.ALT_PORT} h1 true",  # port 2222 refuses the default key
                  f"ssh -i {bed.alt_key} h1 true",  # port 22 refuses the second key
                  "ssh -o PasswordAuthentication=yes -o PubkeyAuthentication=no h1 true"):
        proc = bed.run("h2", ["sh", "-c", wrong], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 255 and "Permission denied" in proc.stderr, (wrong, proc.stderr)


def test_names_and_roots_home_come_back_when_their_binds_come_undone(bed):
    # What replacing /etc/passwd or /etc/hosts on this machine (useradd, apt) does to the
    # binds over them in the hosts' mount namespaces.
    init = str(bed.state["hosts"][0]["init"])
    for name in ("passwd", "hosts"):
        subprocess.run(["nsenter", "-t", init, "-m", "-p", "umount", f"/etc/{name}"], check=True)
    assert run(bed, "h1", "getent passwd root").split(":")[5] == bed.home
    assert run(bed, "h1", "ssh h2 hostname") == "h2"


def test_down_ends_every_process_and_namespace_and_may_run_twice(bed_possible):
    other = testbed.up(2, tied=True)  # a bed of its own, so that the session's stays up
    try:
        pids = [host[key] for host in other.state["hosts"] for key in ("init", "unshare")]
        pids += [entry["pid"] for host in other.state["hosts"] for entry in host["daemons"].values()]
        names = [host["netns"] for host in other.state["hosts"]] + [other.state["switch"]]
        inside = other.popen("h2", ["sleep", "60"])
        other.down()
        inside.wait(timeout=10)
        assert not any(testbed.running(pid) for pid in pids)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(name in listed for name in names)
        assert not any(os.path.exists(f"/etc/netns/{name}") for name in names)
    finally:  # a second down() does nothing
        other.down()
        shutil.rmtree(other.folder)
