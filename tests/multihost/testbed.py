"""A test bed of N hosts (2 to 4) on this one machine, so that jobs cross a real network link.

Each host h1..hN is a network namespace with two links (``lan0`` 10.213.0.i/24 and ``lan1``
10.213.1.i/24, veth pairs to one bridge each in a switch namespace of the bed's own), and a
first process that gives it its own hostname (UTS), IPC, PID and mount namespaces, with a
private tmpfs on /dev/shm and on /tmp, the host-local scratch folder. Without the IPC, mount
and /dev/shm separation MPICH's UCX would move "inter-host" data through shared memory and
nothing would cross the link. Every host runs two sshds of the bed's own: port 22 takes the
bed's default key (root's ``~/.ssh/id_ed25519`` on the hosts), port 2222 only its second key
(``bed.alt_key``), so a launch that drops ``-p`` or ``-i`` is refused. Host names resolve
through ``/etc/netns/<namespace>/hosts``; root's home on the hosts is the bed's ``home``
folder (``/etc/netns/<namespace>/passwd``), so ssh finds the bed's key and known hosts there.
The filesystem is shared (one venv serves every host) except /tmp and /dev/shm.

Nothing gets an address outside 10.213.0.0/16, and only on links inside the bed's namespaces.
``down()`` ends every process the bed started by its recorded PID (checked against its start
time), deletes the namespaces and the /etc/netns entries, and may be called again.

With ``start_slurm()`` (CLI: ``up --slurm``) it also runs Slurm: slurmctld on h1, slurmd on
every host, one munged. The daemons are taken from where Debian installs them unless
HVD_TESTBED_SSHD, HVD_TESTBED_MUNGED, HVD_TESTBED_SLURMCTLD or HVD_TESTBED_SLURMD names
another path.

Module:  bed = testbed.up(3); bed.run("h1", ["hostname"]); bed.down()
CLI:     python tests/multihost/testbed.py up 3 [--slurm] [--dir DIR]
         python tests/multihost/testbed.py run [--dir DIR] h1 -- hostname
         python tests/multihost/testbed.py down [--dir DIR]
"""
import argparse
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

LINKS = ("lan0", "lan1")
SUBNETS = ("10.213.0", "10.213.1")  # one /24 per link
PORT, ALT_PORT = 22, 2222
CLI_DIR = "/var/tmp/hvd-testbed"  # the CLI's default folder, so that `down` finds `up`'s bed


class Daemon(NamedTuple):
    """A daemon the bed runs: where Debian installs it, the variable that points the bed at
    another copy (or at a missing path, to see the tests skip), and the package to install."""
    default: str
    variable: str
    package: str

    @property
    def path(self) -> str:
        """Where the bed takes it from now: the variable's path if set, else Debian's."""
        return os.environ.get(self.variable) or self.default


SSHD = Daemon("/usr/sbin/sshd", "HVD_TESTBED_SSHD", "openssh-server")
MUNGED = Daemon("/usr/sbin/munged", "HVD_TESTBED_MUNGED", "munge")
SLURMCTLD = Daemon("/usr/sbin/slurmctld", "HVD_TESTBED_SLURMCTLD", "slurmctld")
SLURMD = Daemon("/usr/sbin/slurmd", "HVD_TESTBED_SLURMD", "slurmd")
# The commands the bed and its tests run, with the Debian package of each.
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "nsenter": "util-linux",
         "mount": "mount", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
         "ps": "procps", "hostname": "hostname"}
SLURM_TOOLS = {"srun": "slurm-client", "sbatch": "slurm-client", "sinfo": "slurm-client"}
_STATE = "state.json"
_READY_SECONDS = 30.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The first process of each host: reaps whatever is left to it (PID 1 of its namespace).
_INIT = ("import os, time\nwhile True:\n    try:\n        os.waitpid(-1, 0)\n"
         "    except ChildProcessError:\n        time.sleep(1)\n")


class TestBedError(RuntimeError):
    """The test bed could not be built; the message names the step that failed."""


def _missing(daemons: Sequence[Daemon], tools: Dict[str, str], what: str) -> Optional[str]:
    """Which of ``daemons`` and ``tools`` is missing, and the apt-get command that adds it."""
    for daemon in daemons:
        if not os.access(daemon.path, os.X_OK):
            return (f"{what} needs {daemon.path} (apt-get install {daemon.package}, or point "
                    f"{daemon.variable} at it)")
    for tool, package in tools.items():
        if shutil.which(tool) is None:
            return f"{what} needs `{tool}` on PATH (apt-get install {package})"
    return None


def unavailable() -> Optional[str]:
    """Why no test bed can be built on this machine, or None when it can: each reason names
    what is missing and how to get it."""
    if os.geteuid() != 0:
        return ("the multi-host test bed needs root (it makes network, PID and mount "
                "namespaces): run the tests as root, e.g. with sudo")
    missing = _missing([SSHD], TOOLS, "the multi-host test bed")
    if missing:
        return missing
    return _netns_refused()


@functools.lru_cache(maxsize=None)
def _netns_refused() -> Optional[str]:
    """Why ``ip netns add`` fails here, or None; probed once per process (callers ask before
    each test that has a twin on the bed), its namespace deleted even when the probe is cut
    short (a stale /var/run/netns entry outlives the process)."""
    name = f"hvdtb-probe-{secrets.token_hex(3)}"
    try:
        probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if probe.returncode:
            return (f"cannot make a network namespace here (`ip netns add`: "
                    f"{probe.stderr.strip()}); the test bed needs a machine or VM whose root may "
                    "(a container needs CAP_SYS_ADMIN and CAP_NET_ADMIN: docker run "
                    "--privileged)")
        return None
    finally:
        if os.path.exists(os.path.join("/var/run/netns", name)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _sh(*command: str) -> None:
    """Run a setup command; TestBedError quotes it with its error output."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise TestBedError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[19]
    except OSError:
        return None


def child_of(pid: int, seconds: float = _READY_SECONDS) -> int:
    """The child that process ``pid`` forks (unshare and nsenter fork the process that
    enters the new PID namespace)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as children:
                found = children.read().split()
        except OSError:
            raise TestBedError(f"process {pid} ended before it forked") from None
        if found:
            return int(found[0])
        if not running(pid):  # its child failed at once (a missing program), and so did it
            raise TestBedError(f"process {pid} ended with no child left (what it ran failed)")
        time.sleep(0.02)
    raise TestBedError(f"process {pid} did not fork within {seconds:g} s")


def _private_tmp(outer: str) -> str:
    """Shell commands that give a host a /tmp of its own (a tmpfs) in which the checkout and
    the Python environment stay where they are when they live under /tmp (a clone in /tmp
    for CI): the shared /tmp, mounted at ``outer`` for a moment, lends them back."""
    kept = sorted({path for path in (REPO, sys.prefix)
                   if os.path.commonpath([path, "/tmp"]) == "/tmp" and path != "/tmp"})
    commands = [f"mkdir -p {outer}", f"mount --bind /tmp {outer}",
                "mount -t tmpfs -o mode=1777 tmpfs /tmp"]
    for path in kept:
        inner = os.path.join(outer, os.path.relpath(path, "/tmp"))
        commands += [f"mkdir -p {path}", f"mount --bind {inner} {path}"]
    # The lent paths are mounts of their own; without the whole shared /tmp in sight, nothing
    # run in the host can reach the rest of it through the bed's folder.
    return " && ".join(commands + [f"umount {outer}"])


def _set_death_signal() -> None:
    """preexec_fn: SIGKILL this process when its parent dies (the bed dies with pytest)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class TestBed:
    """A running test bed; its state lives in ``folder``/state.json."""

    def __init__(self, folder: str, state: dict):
        self.folder, self.state = folder, state
        self.hosts: List[str] = [host["name"] for host in state["hosts"]]
        self.home = os.path.join(folder, "home")
        self.shared = os.path.join(folder, "shared")  # seen by every host (their /tmp is not)
        self.alt_key = os.path.join(folder, "keys", "alt")

    # -- reading the bed ----------------------------------------------------------------------
    def _host(self, name: str) -> dict:
        for host in self.state["hosts"]:
            if host["name"] == name:
                return host
        raise KeyError(f"no host {name!r} in the test bed (hosts: {', '.join(self.hosts)})")

    def address(self, host: str, link: str = "lan0") -> str:
        """``host``'s address on ``link``."""
        return f"{SUBNETS[LINKS.index(link)]}.{self.hosts.index(host) + 1}"

    def netns(self, host: str) -> str:
        """The name of ``host``'s network namespace (for ``ip -n`` and ``tc -n``)."""
        return self._host(host)["netns"]

    def link_bytes(self, host: str, link: str = "lan0") -> int:
        """Bytes sent plus received so far on ``host``'s ``link``, from the kernel's counters."""
        out = subprocess.run(["ip", "-n", self.netns(host), "-j", "-s", "link", "show", "dev", link],
                             capture_output=True, text=True, check=True).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"] + stats["tx"]["bytes"]

    # -- running in a host --------------------------------------------------------------------
    def command(self, host: str, argv: Sequence[str], cwd: Optional[str] = None) -> List[str]:
        """``argv`` wrapped to run inside ``host``'s namespaces, in ``cwd`` (default: ours)."""
        for host_name in self.hosts:
            self._heal(host_name)
        return ["nsenter", "-t", str(self._host(host)["init"]), "-n", "-u", "-i", "-p", "-m",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def _heal(self, host: str) -> None:
        """Bind the host's /etc/hosts and /etc/passwd again where they came undone: replacing
        /etc/passwd on this machine (useradd, apt) detaches the binds made over it in every
        mount namespace, and the host would lose its names and root's home (ssh's key)."""
        record = self._host(host)
        for name in ("hosts", "passwd"):
            ours = os.path.join("/etc/netns", record["netns"], name)
            try:
                seen = os.stat(f"/proc/{record['init']}/root/etc/{name}")
            except OSError:  # the host is gone: nothing to heal
                return
            mine = os.stat(ours)
            if (seen.st_dev, seen.st_ino) != (mine.st_dev, mine.st_ino):
                _sh("nsenter", "-t", str(record["init"]), "-m", "-p", "mount", "--bind", ours,
                    f"/etc/{name}")

    def run(self, host: str, argv: Sequence[str], cwd: Optional[str] = None,
            **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run of ``argv`` inside ``host``."""
        return subprocess.run(self.command(host, argv, cwd), **kwargs)

    def popen(self, host: str, argv: Sequence[str], cwd: Optional[str] = None,
              **kwargs) -> subprocess.Popen:
        """subprocess.Popen of ``argv`` inside ``host``."""
        return subprocess.Popen(self.command(host, argv, cwd), **kwargs)

    # -- daemons ------------------------------------------------------------------------------
    def _start(self, host: str, name: str, daemon: Daemon, args: Sequence[str], ready: str,
               env: Optional[Dict[str, str]] = None) -> None:
        """Start ``daemon`` with ``args`` (in the foreground, its log on stderr) in ``host`` as
        ``name``, record its PID and wait until its log shows ``ready``."""
        missing = _missing([daemon], {}, "the test bed")
        if missing:  # at once, rather than a wait for a log that nothing writes
            raise TestBedError(missing)
        argv = [daemon.path, *args]
        log = self._log(host, name)
        marker = os.path.getsize(log) if os.path.exists(log) else 0
        with open(log, "ab") as out:
            nsenter = self.popen(host, argv, cwd=self.folder, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=out, env=env, start_new_session=True,
                                 preexec_fn=self._tie())
        pid = child_of(nsenter.pid)
        self._host(host).setdefault("daemons", {})[name] = {
            "pid": pid, "start": _start_time(pid),
            "nsenter": nsenter.pid, "nsenter_start": _start_time(nsenter.pid)}
        self._save()
        self._wait_for(log, marker, ready, nsenter)

    def _stop(self, host: str, prefix: str) -> None:
        """End ``host``'s daemons whose names start with ``prefix``."""
        daemons = self._host(host).get("daemons", {})
        for name in [name for name in daemons if name.startswith(prefix)]:
            entry = daemons.pop(name)
            _kill(entry["pid"], entry["start"])
            _reap(entry["nsenter"])
        self._save()

    def _log(self, host: str, name: str) -> str:
        return os.path.join(self.folder, f"{name}.{host}.log")

    # -- sshd ---------------------------------------------------------------------------------
    def start_sshd(self, host: str) -> None:
        """Start ``host``'s two sshds (port 22: default key, port 2222: alt key) and wait
        until they listen."""
        for port in (PORT, ALT_PORT):
            self._start(host, f"sshd.{port}", SSHD,
                        ["-D", "-e", "-f", self._sshd_config(host, port)],
                        f"Server listening on 0.0.0.0 port {port}.")

    def stop_sshd(self, host: str) -> None:
        """End ``host``'s sshds (sessions they started go on, as when sshd stops for real)."""
        self._stop(host, "sshd.")

    def signal_sshd(self, host: str, signum: int) -> None:
        """Send ``signum`` to ``host``'s sshd listeners (SIGSTOP: a hung host, SIGCONT: back).
        nsenter, their parent, stops itself when they stop: SIGCONT goes to it too."""
        for name, entry in self._host(host).get("daemons", {}).items():
            if name.startswith("sshd.") and _start_time(entry["pid"]) == entry["start"]:
                os.kill(entry["pid"], signum)
                if signum == signal.SIGCONT and _start_time(entry["nsenter"]) == entry["nsenter_start"]:
                    os.kill(entry["nsenter"], signum)

    def sshd_log(self, host: str, port: int = PORT) -> str:
        """What ``host``'s sshd on ``port`` has logged."""
        with open(self._log(host, f"sshd.{port}"), errors="replace") as log:
            return log.read()

    # -- Slurm --------------------------------------------------------------------------------
    def start_slurm(self) -> Dict[str, str]:
        """Run Slurm on the bed: slurmctld on h1, slurmd on every host (node hN, all its CPUs,
        one partition), authenticated by one munged whose socket lies in the bed's folder
        (every host sees it); wait until every node is idle. Returns the variable that
        Slurm's commands need (SLURM_CONF, what /etc/slurm/slurm.conf is on a cluster)."""
        folder = os.path.join(self.folder, "slurm")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        key = os.path.join(folder, "munge.key")
        if not os.path.exists(key):
            with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(os.urandom(1024))
        socket_path = os.path.join(folder, "munge.socket")
        conf = os.path.join(folder, "slurm.conf")
        lines = ["ClusterName=hvdbed", f"SlurmctldHost=h1({self.address('h1')})",
                 "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
                 f"AuthInfo=socket={socket_path}", "CredType=cred/munge",
                 f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool.%n",
                 f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd.%n.pid",
                 "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                 "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres",
                 "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin", "MpiDefault=pmi2",
                 "ReturnToService=2", "AccountingStorageType=accounting_storage/none",
                 "JobCompType=jobcomp/none"]
        lines += [f"NodeName={host} NodeAddr={self.address(host)} CPUs={os.cpu_count()} "
                  "State=UNKNOWN" for host in self.hosts]
        lines.append(f"PartitionName=bed Nodes={','.join(self.hosts)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        with open(conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        # slurmd 22.05 loads a cgroup plugin even when no plugin uses one: cgroup/v1 is
        # content with an empty folder (a private tmpfs on each host; the machine's cgroups
        # stay untouched).
        with open(os.path.join(folder, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        env = {"SLURM_CONF": conf}
        full = dict(os.environ, **env)
        self._start("h1", "munged", MUNGED, ["-F", "-f", f"--socket={socket_path}",
                                             f"--key-file={key}", f"--pid-file={folder}/munged.pid",
                                             f"--seed-file={folder}/munged.seed"],
                    "Created socket")
        self._start("h1", "slurmctld", SLURMCTLD, ["-D", "-f", conf],
                    "Running as primary controller", full)
        for host in self.hosts:
            self.run(host, ["sh", "-c", "mountpoint -q /sys/fs/cgroup || "
                                        "mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup"],
                     check=True)
            os.makedirs(os.path.join(folder, f"spool.{host}"), mode=0o700, exist_ok=True)
            self._start(host, "slurmd", SLURMD, ["-D", "-f", conf], "slurmd started on", full)
        deadline = time.monotonic() + _READY_SECONDS
        while True:
            nodes = self.run("h1", ["sinfo", "-h", "-o", "%T %D"], env=full, capture_output=True,
                             text=True).stdout.split()
            if nodes == ["idle", str(len(self.hosts))]:
                return env
            if time.monotonic() > deadline:
                raise TestBedError(f"Slurm's nodes are not idle after {_READY_SECONDS:g} s: {nodes}")
            time.sleep(0.1)

    def _sshd_config(self, host: str, port: int) -> str:
        path = os.path.join(self.folder, f"sshd.{port}.{host}.conf")
        keys = "authorized_keys" if port == PORT else "authorized_keys.alt"
        # StrictModes off: the bed's folder is owner-only, but it may lie below a
        # world-writable /var/tmp, which StrictModes refuses.
        lines = [f"Port {port}", "ListenAddress 0.0.0.0",
                 f"HostKey {os.path.join(self.folder, 'keys', f'host.{host}')}",
                 f"AuthorizedKeysFile {os.path.join(self.folder, 'keys', keys)}",
                 "PidFile none", "UsePAM no", "StrictModes no", "PermitRootLogin prohibit-password",
                 "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                 "PubkeyAuthentication yes", "PrintMotd no", "MaxStartups 100:30:200",
                 "MaxSessions 100", "LogLevel VERBOSE"]
        with open(path, "w") as config:
            config.write("\n".join(lines) + "\n")
        return path

    def _wait_for(self, log: str, offset: int, text: str, process: subprocess.Popen) -> None:
        deadline = time.monotonic() + _READY_SECONDS
        while time.monotonic() < deadline:
            with open(log, errors="replace") as f:
                f.seek(offset)
                if text in f.read():
                    return
            if process.poll() is not None:
                break
            time.sleep(0.05)
        raise TestBedError(f"a daemon did not come up ({text!r} not in {log}): "
                           f"{open(log, errors='replace').read()[-2000:]}")

    def _tie(self):
        return _set_death_signal if self.state.get("tied") else None

    def _save(self) -> None:
        tmp = os.path.join(self.folder, f"{_STATE}.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600),
                  "w") as f:
            json.dump(self.state, f, indent=1)
        os.replace(tmp, os.path.join(self.folder, _STATE))

    # -- teardown -----------------------------------------------------------------------------
    def down(self) -> None:
        """End everything the bed started, by PID, and remove its namespaces; idempotent."""
        for host in self.state["hosts"]:
            for entry in host.pop("daemons", {}).values():
                _kill(entry["pid"], entry["start"])
                # A PID namespace ends only when all its processes are collected, which their
                # parent outside it, nsenter, does.
                _kill(entry["nsenter"], entry["nsenter_start"])
            # Killing a PID namespace's first process ends every process in it.
            for key in ("init", "unshare"):
                if host.get(key):
                    _kill(host[key], host.get(f"{key}_start"))
        for host in self.state["hosts"]:
            for key in ("init", "unshare"):
                if host.get(key):
                    _reap(host[key])
                    host[key] = None
        self._save()
        for name in [host["netns"] for host in self.state["hosts"]] + [self.state["switch"]]:
            if os.path.exists(f"/var/run/netns/{name}"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _kill(pid: int, start: Optional[str]) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``start``."""
    if pid and start is not None and _start_time(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reap(pid: int) -> None:
    """Wait (briefly) for ``pid`` to be gone, collecting it if it is our child."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:  # not ours: wait for /proc to drop it
            if not running(pid):
                return
        time.sleep(0.02)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def slurm_unavailable() -> Optional[str]:
    """Why the bed cannot run Slurm here, or None when it can (naming what to install)."""
    return _missing([MUNGED, SLURMCTLD, SLURMD], SLURM_TOOLS, "Slurm on the test bed")


def up(count: int, folder: Optional[str] = None, tied: bool = False) -> TestBed:
    """Build a bed of ``count`` hosts (2 to 4) in ``folder`` (default: a new one under
    /var/tmp; an old bed there is taken down first). With ``tied``, the hosts die with this
    process (for pytest). On failure what was built is taken down and TestBedError raised."""
    if not 2 <= count <= 4:
        raise ValueError(f"a test bed has 2 to 4 hosts, not {count}")
    if folder is None:
        folder = tempfile.mkdtemp(prefix="hvd-testbed.", dir="/var/tmp")
    elif os.path.exists(os.path.join(folder, _STATE)):
        load(folder).down()
    if os.path.realpath(folder).startswith("/tmp/"):
        raise ValueError(f"{folder!r}: the bed's folder must not lie in /tmp, which is "
                         "host-local on the bed's hosts")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    prefix = f"hvdtb{secrets.token_hex(3)}"
    state = {"prefix": prefix, "switch": f"{prefix}-sw", "tied": tied,
             "hosts": [{"name": f"h{i}", "netns": f"{prefix}-h{i}"} for i in range(1, count + 1)]}
    bed = TestBed(folder, state)
    bed._save()
    try:
        _build(bed)
    except BaseException:
        bed.down()
        raise
    return bed


def load(folder: str = CLI_DIR) -> TestBed:
    """The bed whose state is in ``folder``."""
    with open(os.path.join(folder, _STATE)) as f:
        return TestBed(folder, json.load(f))


def _build(bed: TestBed) -> None:
    folder, state = bed.folder, bed.state
    for sub in ("keys", "shared", os.path.join("home", ".ssh")):
        os.makedirs(os.path.join(folder, sub), mode=0o700, exist_ok=True)
    os.chmod(bed.shared, 0o755)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
    keys = os.path.join(folder, "keys")
    ssh_dir = os.path.join(bed.home, ".ssh")
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvd-testbed",
        "-f", os.path.join(ssh_dir, "id_ed25519"))
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvd-testbed-alt", "-f", bed.alt_key)
    shutil.copy(os.path.join(ssh_dir, "id_ed25519.pub"), os.path.join(keys, "authorized_keys"))
    shutil.copy(bed.alt_key + ".pub", os.path.join(keys, "authorized_keys.alt"))
    known = []
    for host in bed.hosts:
        key = os.path.join(keys, f"host.{host}")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host, "-f", key)
        with open(key + ".pub") as pub:
            public = " ".join(pub.read().split()[:2])
        names = [host] + [bed.address(host, link) for link in LINKS]
        known.append(f"{','.join(names)} {public}")
        known.append(f"{','.join(f'[{n}]:{ALT_PORT}' for n in names)} {public}")
    with open(os.path.join(ssh_dir, "known_hosts"), "w") as f:
        f.write("\n".join(known) + "\n")
    with open(os.path.join(ssh_dir, "config"), "w") as f:
        f.write("Host *\n  BatchMode yes\n  StrictHostKeyChecking yes\n  ConnectTimeout 10\n")
    with open("/etc/passwd") as f:
        passwd = [line.split(":") for line in f.read().splitlines()]
    for fields in passwd:
        if fields[0] == "root":
            fields[5] = bed.home
    hosts_file = ["127.0.0.1 localhost", "::1 localhost"]
    hosts_file += [f"{bed.address(host)} {host}" for host in bed.hosts]

    _sh("ip", "netns", "add", state["switch"])
    for index, link in enumerate(LINKS):
        _sh("ip", "-n", state["switch"], "link", "add", f"br{index}", "type", "bridge")
        _sh("ip", "-n", state["switch"], "link", "set", f"br{index}", "up")
    for record in state["hosts"]:
        host, netns = record["name"], record["netns"]
        etc = f"/etc/netns/{netns}"
        os.makedirs(etc, mode=0o755, exist_ok=True)
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write("\n".join(hosts_file) + "\n")
        with open(os.path.join(etc, "passwd"), "w") as f:
            f.write("\n".join(":".join(fields) for fields in passwd) + "\n")
        _sh("ip", "netns", "add", netns)
        _sh("ip", "-n", netns, "link", "set", "lo", "up")
        for index, link in enumerate(LINKS):
            port = f"{host}-{index}"
            _sh("ip", "-n", state["switch"], "link", "add", port, "type", "veth",
                "peer", "name", link, "netns", netns)
            _sh("ip", "-n", state["switch"], "link", "set", port, "master", f"br{index}")
            _sh("ip", "-n", state["switch"], "link", "set", port, "up")
            _sh("ip", "-n", netns, "addr", "add", f"{bed.address(host, link)}/24", "dev", link)
            _sh("ip", "-n", netns, "link", "set", link, "up")
        ready = os.path.join(folder, f"ready.{host}")
        setup = (f"hostname {host} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                 f"{_private_tmp(os.path.join(folder, f'tmp.{host}'))} && touch {ready} && "
                 f"exec {sys.executable} -c '{_INIT}'")
        unshare = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--uts", "--ipc", "--pid", "--fork",
             "--mount-proc", "--kill-child", "--", "sh", "-c", setup],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=bed._tie())
        record["unshare"], record["unshare_start"] = unshare.pid, _start_time(unshare.pid)
        init = child_of(unshare.pid)
        record["init"], record["init_start"] = init, _start_time(init)
        bed._save()
        deadline = time.monotonic() + _READY_SECONDS
        while not os.path.exists(ready):
            if unshare.poll() is not None or time.monotonic() > deadline:
                raise TestBedError(f"host {host} did not start (its setup `{setup}` failed)")
            time.sleep(0.02)
    for host in bed.hosts:
        bed.start_sshd(host)


def main(argv: Optional[List[str]] = None) -> int:
    """The CLI: ``up N``, ``run HOST -- COMMAND``, ``down``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=CLI_DIR, help=f"the bed's folder (default {CLI_DIR})")
    sub = parser.add_subparsers(dest="action", required=True)
    build = sub.add_parser("up", parents=[common], help="build the bed")
    build.add_argument("count", type=int)
    build.add_argument("--slurm", action="store_true", help="and run Slurm on it")
    run = sub.add_parser("run", parents=[common], help="run a command inside a host")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("down", parents=[common], help="take the bed down")
    args = parser.parse_args(argv)
    if args.action == "up":
        reason = unavailable()
        if reason:
            parser.exit(1, f"testbed: {reason}\n")
        reason = slurm_unavailable() if args.slurm else None
        if reason:
            parser.exit(1, f"testbed: {reason}\n")
        bed = up(args.count, args.dir)
        print(f"test bed in {bed.folder}: " + ", ".join(
            f"{host} ({bed.address(host)}, {bed.address(host, 'lan1')})" for host in bed.hosts))
        if args.slurm:
            conf = bed.start_slurm()["SLURM_CONF"]
            print(f"Slurm: run its commands in a host with SLURM_CONF={conf}")
        return 0
    if not os.path.exists(os.path.join(args.dir, _STATE)):
        if args.action == "down":
            return 0
        parser.exit(1, f"testbed: no test bed in {args.dir}\n")
    bed = load(args.dir)
    if args.action == "down":
        bed.down()
        shutil.rmtree(args.dir, ignore_errors=True)
        return 0
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return bed.run(args.host, argv).returncode


if __name__ == "__main__":
    sys.exit(main())
