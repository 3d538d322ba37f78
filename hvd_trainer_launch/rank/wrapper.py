"""Per-rank wrapper that hvdrun starts through mpiexec: ``python -m hvd_trainer_launch.rank.wrapper -- cmd ...``.

The wrapper runs the user's command as a child that inherits the environment and every file
descriptor (MPICH's PMI hands the rank an fd), and exits with the child's exit code. It reports
to hvdrun's report port (hvd_trainer_launch/protocol.py) that the rank has started, and on which host
(for ``--start-timeout`` and messages), and, after the child's output, a non-zero exit with its
time (reports from other hosts arrive late, so hvdrun orders them by it): never through the
output, which a rank could fill with anything. From the hosts hvdrun hands it
(``HVDRUN_HOSTS``) it sets Horovod's per-rank variables (HOROVOD_RANK, _SIZE, _LOCAL_RANK,
_LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE, _HOSTNAME) for the child. Under ``hvdrun --horovod`` it
gives the child a horovod shim of its own (hvd_trainer_launch/rank/horovod_shim.py) on PYTHONPATH, and removes
it when the child ends.

The child's output goes through pipes to a separate relay process, in its own session, that
prefixes each line with the rank and writes whole lines only (protocol.pieces), so that MPICH's
Hydra, which interleaves the ranks' output by reads, never splices two ranks' lines. It is
separate because on MPI_Abort the launcher SIGKILLs the wrapper at once: a relay inside the
wrapper would lose the traceback that explains the abort, while a relay that the launcher does
not know about can still copy it out. A relay that dies before the child ends the rank with a
message, rather than losing its output silently.

No rank outlives hvdrun: hvdrun's mpiexec dies with it (job.run_job), and the wrapper ends
its child (SIGTERM, then SIGKILL) once the launcher process that started it is gone, which
the kernel signals (PR_SET_PDEATHSIG) and the wrapper also checks while it waits.
"""
import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hvd_trainer_launch import mpi, offers, protocol
from hvd_trainer_launch.files import open_mpi_sessions
from hvd_trainer_launch.processes import PR_SET_PDEATHSIG, die_with_parent, still_there
from hvd_trainer_launch.protocol import HOSTS_VARIABLE
from hvd_trainer_launch.rank import horovod_shim
from hvd_trainer_launch.rank.segments import Segments, sweep_orphans

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
# How many ranks the launcher put on this host: Hydra's variable, then Open MPI's.
_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
# What the launchers tell a rank of its place on its node, and the Horovod variable each must
# equal. (Open MPI's OMPI_COMM_WORLD_LOCAL_RANK does not follow the rank order, MPI's does.)
_LAUNCHER_PLACE = (("MPI_LOCALRANKID", "HOROVOD_LOCAL_RANK"),
                   ("MPI_LOCALNRANKS", "HOROVOD_LOCAL_SIZE"),
                   ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE"))
# What a user sets to choose numpy's BLAS threads (OpenBLAS reads them in this order).
_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
# What the kernel sends the wrapper when its parent goes: a signal of its own, since the end of
# the parent's thread that started it sends it too, and then the parent is still there.
_PARENT_GONE = signal.SIGRTMIN
_CHECK_SECONDS = 0.25  # how often the wrapper checks its parent and the relay while it waits
_KILL_GRACE_SECONDS = 2.0  # after SIGTERM, how long the child has before SIGKILL
# Once the child has exited (or the wrapper has died), how long the relay may keep copying output
# from processes the child left behind before it gives up.
_DRAIN_SECONDS = 2.0


def launcher_rank(environ: Mapping[str, str]) -> Optional[int]:
    """The rank the MPI launcher gave this process (Hydra, Open MPI, PMIx or Slurm), or None."""
    for name in RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def horovod_variables(nodes: Sequence[Tuple[str, int]], rank: int) -> Dict[str, str]:
    """Horovod's per-rank variables of ``rank`` when the ranks fill ``nodes`` (host, ranks) in
    order (a host may come again: a job grown in place puts its new ranks last): the local
    rank counts the ranks before this one on its host, and the cross rank the ranks before
    this one with the same local rank, as MPI's splits of the world do."""
    slots = [host for host, count in nodes for _ in range(count)]
    if rank >= len(slots):
        raise ValueError(f"rank {rank} is beyond the {len(slots)} ranks of {HOSTS_VARIABLE}")
    host = slots[rank]
    places: Dict[str, int] = {}  # ranks seen so far on each host
    local = []  # each rank's local rank
    for name in slots:
        local.append(places.get(name, 0))
        places[name] = local[-1] + 1
    peers = [other for other, place in enumerate(local) if place == local[rank]]
    return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(len(slots)),
            "HOROVOD_LOCAL_RANK": str(local[rank]), "HOROVOD_LOCAL_SIZE": str(places[host]),
            "HOROVOD_CROSS_RANK": str(peers.index(rank)), "HOROVOD_CROSS_SIZE": str(len(peers)),
            "HOROVOD_HOSTNAME": host}


def _placed_otherwise(variables: Mapping[str, str], environ: Mapping[str, str]) -> Optional[str]:
    """How the launcher's own view of this rank's place differs from ``variables``, or None."""
    for launcher_name, name in _LAUNCHER_PLACE:
        if environ.get(launcher_name, variables[name]) != variables[name]:
            return (f"{launcher_name}={environ[launcher_name]}, hvdrun's hosts give "
                    f"{name}={variables[name]}")
    return None


def _with_horovod_variables(env: Dict[str, str], rank: int, joined: bool = False) -> bytes:
    """Put Horovod's per-rank variables into ``env`` from hvdrun's hosts; return a warning
    line for stderr when the launcher placed the rank otherwise (then only HOROVOD_RANK and
    HOROVOD_SIZE are set: the others would be wrong). A rank that joined a running job
    (``joined``) is not checked: its launcher saw only the ranks started with it."""
    variables = horovod_variables(json.loads(env[HOSTS_VARIABLE]), rank)
    for name in variables:  # an enclosing job's values must not leak through
        env.pop(name, None)
    otherwise = None if joined else _placed_otherwise(variables, env)
    if otherwise is None:
        env.update(variables)
        return b""
    env.update(HOROVOD_RANK=variables["HOROVOD_RANK"], HOROVOD_SIZE=variables["HOROVOD_SIZE"])
    return (f"[{rank}]<stderr>:hvdrun: warning: mpiexec placed rank {rank} otherwise than the "
            f"hosts given ({otherwise}), e.g. through --mpi-args; HOROVOD_LOCAL_*, "
            "HOROVOD_CROSS_* and HOROVOD_HOSTNAME are not set (hvd_trainer.local_rank() and "
            "the others ask MPI)\n").encode()


def _end_of(pid: int) -> Optional[Tuple[bool, int]]:
    """How child ``pid`` ended, without reaping it: (killed by a signal, the signal or exit
    code); (False, -1) once reaped; None while it runs."""
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False, -1
    if found is None:
        return None
    return found.si_code in (os.CLD_KILLED, os.CLD_DUMPED), found.si_status


def report(rank: int, message: protocol.Report) -> None:
    """Send ``message`` to hvdrun's report port; when that fails, say so on stderr (the job
    goes on, but hvdrun may not name this rank's failure)."""
    address = os.environ.get(protocol.REPORTS_VARIABLE)
    secret = protocol.job_secret()
    if not address or secret is None:
        return  # started by a bare mpiexec: nobody to tell
    try:
        protocol.send_report(address, secret, message)
    except (OSError, ValueError) as error:
        _write_all(2, f"[{rank}]<stderr>:hvdrun: warning: rank {rank} cannot report to hvdrun "
                      f"at {address} ({error}); check that this host reaches hvdrun's host "
                      "(--network-interface)\n".encode())


def _timestamp() -> bytes:
    """The local time with milliseconds, as output lines are stamped with it."""
    now = time.time()
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d} ".encode()


def _signal_when_parent_goes() -> int:
    """Ask the kernel for _PARENT_GONE when the wrapper's parent goes; return the parent."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, _PARENT_GONE)
    return os.getppid()


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (pipes may take it in parts)."""
    while data:
        data = data[os.write(fd, data):]


def _write_lines(fd: int, pieces: List[bytes]) -> None:
    """Write ``pieces`` (each at most protocol.PIECE_BYTES) to ``fd``, several at a time
    but never more than PIECE_BYTES in one write(), so that each write reaches a pipe whole."""
    batch = b""
    for piece in pieces:
        if len(batch) + len(piece) > protocol.PIECE_BYTES:
            _write_all(fd, batch)
            batch = b""
        batch += piece
    _write_all(fd, batch)


def _relay(sources: Dict[int, int], rank: int, wrapper: int, stamp: bool,
           segments: Segments) -> None:
    """Copy each source fd to its target fd line by line, prefixed with the rank (and with the
    time when ``stamp``), until all close.

    ``sources`` maps the child's stdout/stderr pipes to our stdout/stderr. Stops early when the
    wrapper has been gone for _DRAIN_SECONDS (the child's own children may hold the pipes open).
    Meanwhile ``segments`` looks at the child's shared memory.
    """
    prefixes = {source: protocol.line_prefix(rank, protocol.STREAMS[target - 1])
                for source, target in sources.items()}
    continued = {source: protocol.line_prefix(rank, protocol.STREAMS[target - 1], continued=True)
                 for source, target in sources.items()}
    pending = {source: b"" for source in sources}
    selector = selectors.DefaultSelector()
    for source in sources:
        selector.register(source, selectors.EVENT_READ)
    deadline = None
    while selector.get_map():
        segments.look()
        for key, _ in selector.select(timeout=min(0.2, segments.wait_seconds())):
            source = key.fd
            data = os.read(source, 1 << 16)
            if not data:
                selector.unregister(source)
                data = b"\n" if pending[source] else b""
            lines = (pending[source] + data).split(b"\n")
            pending[source] = lines.pop()
            while len(pending[source]) > protocol.MAX_LINE:
                lines.append(pending[source][:protocol.MAX_LINE])
                pending[source] = pending[source][protocol.MAX_LINE:]
            if lines:
                prefix = prefixes[source] + (_timestamp() if stamp else b"")
                _write_lines(sources[source], [piece for line in lines
                                               for piece in protocol.pieces(prefix, continued[source], line)])
        if deadline is None and os.getppid() != wrapper:
            deadline = time.monotonic() + _DRAIN_SECONDS
        if deadline is not None and time.monotonic() > deadline:
            return


def _start_relay(child: subprocess.Popen, rank: int, stamp: bool) -> int:
    """Fork the relay process for the child's output pipes; return its pid."""
    wrapper = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()  # out of the wrapper's process group, so a kill aimed at the rank spares it
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, _PARENT_GONE):
                signal.signal(signum, signal.SIG_DFL)
            segments = Segments(child.pid)
            try:
                _relay({child.stdout.fileno(): 1, child.stderr.fileno(): 2}, rank, wrapper, stamp,
                       segments)
            finally:
                segments.remove()
            code = 0
        finally:
            os._exit(code)
    child.stdout.close()
    child.stderr.close()
    return pid


def _relay_failure(status: int) -> Optional[str]:
    """How a relay that ended with wait ``status`` before the child failed, or None when it
    just finished (the child closed its output)."""
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    code = os.WEXITSTATUS(status)
    return f"failed (exit code {code})" if code else None


def _wait_child(child: subprocess.Popen, relay: int, parent: int, rank: int) -> Tuple[int, bool]:
    """The child's wait status, and whether the relay ended (and was reaped) before it.

    The child is ended (SIGTERM, SIGKILL after _KILL_GRACE_SECONDS) when the wrapper's parent
    is gone (the launcher died: hvdrun is gone), when the engine agent that started the
    launcher's proxy here is (protocol.ENGINE_AGENT_VARIABLE), or when the relay failed (the
    rank's output would be lost); the relay's failure is reported on stderr, and the child's
    status is then 1.
    """
    agent = os.environ.get(protocol.ENGINE_AGENT_VARIABLE, "")
    ending_since: Optional[float] = None
    relay_ended, relay_failed = False, False

    def end() -> None:
        nonlocal ending_since
        if ending_since is None:
            ending_since = time.monotonic()
            child.terminate()

    def parent_gone(_signum, _frame) -> None:
        if os.getppid() != parent:
            end()

    signal.signal(_PARENT_GONE, parent_gone)
    while True:
        try:
            status = child.wait(timeout=_CHECK_SECONDS)
            return (1 if relay_failed else status), relay_ended
        except subprocess.TimeoutExpired:
            pass
        if not relay_ended:
            pid, wait_status = os.waitpid(relay, os.WNOHANG)
            relay_ended = pid != 0
            how = _relay_failure(wait_status) if relay_ended else None
            if how:
                relay_failed = True
                _write_all(2, f"[{rank}]<stderr>:hvdrun: the output relay of rank {rank} (pid "
                              f"{relay}) {how}; ending the rank, whose output would be lost\n"
                           .encode())
                end()
        if os.getppid() != parent or (agent and not still_there(agent)):
            end()
        if ending_since is not None and time.monotonic() > ending_since + _KILL_GRACE_SECONDS:
            child.kill()


def _bus_error(rank: int, launcher_flavour: str) -> bytes:
    """The line that explains a rank killed by SIGBUS: MPI's shared memory in a full /dev/shm."""
    advice = mpi.shared_memory_advice(launcher_flavour, _local_size(os.environ)) or (
        f"{mpi.SHARED_MEMORY} may have been full when MPI wrote its shared memory there")
    return (f"[{rank}]<stderr>:hvdrun: rank {rank} on {socket.gethostname()} was killed by "
            f"SIGBUS: {advice}\n").encode()


def _wait_relay(pid: int) -> None:
    """Let the relay finish copying the child's output; kill it after _DRAIN_SECONDS."""
    deadline = time.monotonic() + _DRAIN_SECONDS
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command after ``--`` on this rank; return its exit code (128+N if killed by signal N)."""
    command = sys.argv[1:] if argv is None else list(argv)
    joining = None
    if command[:1] == [offers.JOINED_FLAG] and len(command) > 1:  # started by a growth in place
        try:
            joining = offers.read_joining(command[1])
        except ValueError as error:
            print(f"hvd_trainer_launch.rank.wrapper: {error}", file=sys.stderr)
            return 2
        command = command[2:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m hvd_trainer_launch.rank.wrapper [--joined JSON] -- command "
              "[args ...]", file=sys.stderr)
        return 2
    parent = _signal_when_parent_goes()
    # Until the child runs, the signal only wakes the wrapper (its default would kill it);
    # _wait_child then checks the parent. A handler, unlike SIG_IGN, is not inherited by exec.
    signal.signal(_PARENT_GONE, lambda _signum, _frame: None)
    rank = launcher_rank(os.environ)
    if rank is None:
        print(f"hvd_trainer_launch.rank.wrapper: none of {', '.join(RANK_VARIABLES)} is set; "
              "start it through hvdrun or mpiexec", file=sys.stderr)
        return 2
    place = rank  # in the world of ranks; hvdrun numbers a new rank after all the life's
    if joining is not None:
        place, rank = joining.world_first + rank, joining.first + rank
    report(rank, protocol.Started(rank, socket.gethostname()))
    sweep_orphans()  # what an earlier job killed whole left in /dev/shm
    # and, once a host, what its Open MPI launchers left, for the next job there
    if os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") == "0":
        open_mpi_sessions.sweep()
    env = _child_environment(place, joining)
    try:  # hvdrun --horovod: the rank's own horovod shim, gone when the rank ends
        shim = horovod_shim.prepare(env) if horovod_shim.requested(env) else None
    except (horovod_shim.RealHorovodError, OSError) as error:
        why = error if isinstance(error, horovod_shim.RealHorovodError) else (
            f"--horovod: cannot write the rank's horovod shim ({error}); set TMPDIR to a "
            "writable folder")
        _write_all(2, f"[{rank}]<stderr>:hvdrun: {why}\n".encode())
        report(rank, protocol.Exited(rank, 2, time.time()))
        return 2
    sys.stdout.flush()
    # The launcher's signals and SIGCHLD wait, blocked, until their handlers below exist: a
    # SIGTERM that came while the child started killed the wrapper without an exit report.
    handled = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    try:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 close_fds=False, preexec_fn=die_with_parent(unblock=handled))
    except OSError as error:
        horovod_shim.remove(shim)
        code = (protocol.NOT_FOUND_EXIT_CODE if isinstance(error, FileNotFoundError)
                else protocol.CANNOT_EXECUTE_EXIT_CODE)
        _write_all(2, f"[{rank}]<stderr>:hvdrun: cannot run {command[0]!r}: {error.strerror}\n"
                   .encode())
        report(rank, protocol.Exited(rank, code, time.time()))
        return code
    end = _ChildEnd(child)
    signal.signal(signal.SIGCHLD, end.notice)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, end.forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
    relay = _start_relay(child, rank, os.environ.get(protocol.TIMESTAMP_VARIABLE) == "1")
    returncode, relay_ended = _wait_child(child, relay, parent, rank)
    horovod_shim.remove(shim)
    end.notice()
    if not relay_ended:
        _wait_relay(relay)
    return _report_end(rank, returncode, end)


def _child_environment(place: int, joining: Optional[offers.Joining]) -> Dict[str, str]:
    """The command's environment: the wrapper's, unbuffered Python, marked as a rank's, without
    the report port (the wrapper's, not for the command's own launches); where hvdrun placed
    the ranks, Horovod's variables for rank ``place`` (said on stderr when the launcher placed
    them otherwise). A rank that joined a running job gets the grown job's hosts and
    generation (``joining``)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # so Python ranks' prints arrive live and survive a crash
    env[protocol.WORKER_VARIABLE] = "1"
    env.pop(protocol.REPORTS_VARIABLE, None)
    if joining is not None:
        env[HOSTS_VARIABLE] = json.dumps(joining.world)
        env[protocol.GENERATION_VARIABLE] = str(joining.generation)
    if HOSTS_VARIABLE in env:
        _write_all(2, _with_horovod_variables(env, place, joined=joining is not None))
    env.update(blas_share(env, len(os.sched_getaffinity(0))))
    return env


def blas_share(env: Mapping[str, str], cores: int) -> Dict[str, str]:
    """OPENBLAS_NUM_THREADS for a rank that shares its host's ``cores`` with other ranks, when
    the user chose no BLAS thread count: its share of them. numpy's OpenBLAS otherwise starts
    a thread per core in every rank (the frameworks' OpenMP runtimes share the cores among
    MPI's local ranks themselves), and the ranks' matrix products (PowerSGD's, during
    backward) then take turns on cores that backward already fills. Empty otherwise."""
    if any(name in env for name in _BLAS_THREAD_VARIABLES):
        return {}
    local = _local_size(env)
    return {"OPENBLAS_NUM_THREADS": str(max(1, cores // local))} if local > 1 else {}


def _local_size(env: Mapping[str, str]) -> int:
    """How many ranks run on this host: the launcher's count, else hvdrun's, else 1."""
    return next((int(env[name]) for name in (*_LOCAL_SIZE_VARIABLES, "HOROVOD_LOCAL_SIZE")
                 if env.get(name, "").isdigit()), 1)


class _ChildEnd:
    """The child's end as the wrapper sees it: when (SIGCHLD, this host's clock) and how it
    was first seen ended, and the launcher's signals passed on to it (``signalled``)."""

    def __init__(self, child: subprocess.Popen):
        self.child = child
        self.signalled: List[int] = []
        self.ended: List[Tuple[float, Tuple[bool, int]]] = []

    def notice(self, _signum: Optional[int] = None, _frame: Any = None) -> None:
        if not self.ended:
            how = _end_of(self.child.pid)
            if how is not None:
                self.ended.append((time.time(), how))

    def forward(self, received: int, _frame) -> None:
        # A child that ended before the launcher's signal reached the wrapper was not ended by
        # it, unless the same signal killed it (sent to the wrapper's process group): after a
        # rank is killed on its host, Open MPI may signal every rank, that one's wrapper
        # included, before the wrapper has woken to its child's end.
        self.notice()
        if self.ended and self.ended[0][1] != (True, received):
            return
        self.signalled.append(received)
        if not self.ended:
            self.child.send_signal(received)


def _report_end(rank: int, returncode: int, end: _ChildEnd) -> int:
    """Report the child's end to hvdrun and return the wrapper's exit code; under --ulfm, a
    child killed by a signal is died of by the wrapper too."""
    code = returncode if returncode >= 0 else 128 - returncode
    exited = protocol.Exited(rank, code, at=end.ended[0][0],  # not the drain's time
                             killed=returncode < 0, ended=bool(end.signalled))
    if returncode == -signal.SIGBUS:
        _write_all(2, _bus_error(rank, mpi.OPENMPI if "OMPI_COMM_WORLD_RANK" in os.environ
                                 else mpi.HYDRA))
    # Every exit is reported, 0 too: hvdrun tells a rank that ended well from one whose
    # wrapper never got to say (its host's daemon lost while mpiexec exits 0).
    report(rank, exited)
    if returncode < 0 and os.environ.get(protocol.ULFM_VARIABLE) == "1":
        # Die as the rank died: Open MPI's runtime tells the other ranks at once of a process
        # it started that a signal killed (ULFM), while a wrapper's exit code ends the job.
        if returncode != -signal.SIGKILL:
            signal.signal(-returncode, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {-returncode})
        os.kill(os.getpid(), -returncode)
    return code


if __name__ == "__main__":
    sys.exit(main())
