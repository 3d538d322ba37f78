"""Elastic mode's hosts: what the discovery script (or -H/--hostfile) says, and how a life's
ranks are laid out on them (Horovod's runner/elastic/discovery.py has this job there)."""
import os
import signal
import subprocess
import threading
from typing import Dict, List, Optional, Tuple

from hvd_trainer_launch import mpi

DISCOVERY_INTERVAL = 1.0  # seconds between runs of the discovery script
DISCOVERY_TIMEOUT = 30.0  # seconds a discovery script may take

Hosts = List[Tuple[str, int]]


def parse_discovered(text: str, slots_per_host: Optional[int]) -> Hosts:
    """The hosts a discovery script printed: ``host:slots`` or ``host`` a line (then
    ``slots_per_host``, default 1); blank lines are skipped."""
    hosts = []
    for line in text.splitlines():
        entry = line.strip()
        if entry:
            host, _, slots = entry.partition(":")
            hosts.append(mpi.host_entry(host.strip(), slots.strip() or str(slots_per_host or 1),
                                        entry))
    return hosts


class Discovery:
    """The hosts now: from the discovery script, or the fixed -H/--hostfile list."""

    def __init__(self, script: Optional[str], fixed: Hosts, slots_per_host: Optional[int]):
        self.script, self.fixed, self.slots_per_host = script, fixed, slots_per_host
        self._running: Optional[subprocess.Popen] = None
        # Held from the script's start until _running names it, so that a stop() called as
        # the script starts waits for it and kills it rather than finding no run under way.
        self._starting = threading.Lock()

    def hosts(self) -> Hosts:
        """Run the script, in a process group of its own that is killed when it is over
        DISCOVERY_TIMEOUT, :meth:`stop` is called, or hvdrun leaves while it runs (whatever
        the script started goes with it); ValueError says why its answer cannot be used."""
        if not self.script:
            return list(self.fixed)
        try:
            with self._starting:
                process = subprocess.Popen([self.script], stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True, start_new_session=True)
                self._running = process
        except OSError as error:
            raise ValueError(f"--host-discovery-script {self.script!r} failed: {error}") from None
        try:
            out, err = process.communicate(timeout=DISCOVERY_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise ValueError(f"--host-discovery-script {self.script!r} did not finish within "
                             f"{DISCOVERY_TIMEOUT:g} s") from None
        finally:
            self._running = None
            if process.poll() is None:  # timed out, or hvdrun leaves (a signal)
                _kill_group(process)
                process.wait()
                process.stdout.close()
                process.stderr.close()
        if process.returncode:
            why = (f"was killed by signal {-process.returncode}" if process.returncode < 0 else
                   f"exited with code {process.returncode}")
            raise ValueError(f"--host-discovery-script {self.script!r} {why}: "
                             f"{err.strip()[-300:]}")
        return parse_discovered(out, self.slots_per_host)

    def stop(self) -> None:
        """Kill the script's run under way, if any (from another thread), with its group."""
        with self._starting:
            process = self._running
        if process is not None:
            _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s process group (it leads one: start_new_session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def allocate(hosts: Hosts, np: int) -> Hosts:
    """``np`` ranks on ``hosts`` in order, filling each host's slots: the (host, ranks) used."""
    layout = []
    for host, slots in hosts:
        if np <= 0:
            break
        layout.append((host, min(slots, np)))
        np -= min(slots, np)
    return layout


def per_host(layout: Hosts) -> Dict[str, int]:
    """How many ranks ``layout`` puts on each host (a host may come more than once: a job
    grown in place has its new ranks last)."""
    counts: Dict[str, int] = {}
    for host, ranks in layout:
        counts[host] = counts.get(host, 0) + ranks
    return counts


def host_of(layout: Hosts, rank: int) -> Optional[str]:
    """The host that ``layout`` puts ``rank`` on."""
    for host, count in layout:
        if rank < count:
            return host
        rank -= count
    return None


def hosts_text(hosts: Hosts) -> str:
    """``hosts`` as hvdrun's messages write them: host:slots,..."""
    return ",".join(f"{host}:{slots}" for host, slots in hosts)
