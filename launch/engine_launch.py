"""The launching side of an engine job (hvd_trainer.spark, hvd_trainer.ray): hvdrun with
MPICH's manual launcher, whose proxy command lines go to the engine's agents instead of ssh,
and the gathering of the ranks' outcomes that the agents carry back.

hvdrun runs as it does for a script (its wrapper per rank, HOROVOD_* variables, the report
port, a failure naming its rank and host, the start timeout), under the guard that ends the
job when this process dies. Its output is shown as it comes, except the launcher's
``HYDRA_LAUNCH`` lines, which are kept for the agents; its own messages are kept too, for the
error that a failed job raises.
"""
import io
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from hvd_trainer_launch import horovod_shim, mpi, protocol

# After asking hvdrun to end the job, how long before it is SIGKILLed.
_KILL_GRACE_SECONDS = 10.0
# hvdrun's own lines on stderr start so.
_HVDRUN_MESSAGE = b"hvdrun: "


class EngineError(RuntimeError):
    """An engine job failed: a rank raised or died, an agent was lost, or it never started."""


def check_launcher(mpiexec: Optional[str] = None) -> None:
    """EngineError unless the MPI launcher is MPICH's Hydra, whose manual launcher the engines
    drive (Open MPI has none)."""
    try:
        launcher = mpi.find_launcher(mpiexec)
    except mpi.MPIError as error:
        raise EngineError(str(error)) from None
    if launcher.flavour != mpi.HYDRA:
        raise EngineError(f"{launcher.path} is Open MPI's launcher; hvd_trainer's Spark and Ray "
                          "engines drive MPICH's manual launcher (mpiexec -launcher manual), "
                          "which Open MPI lacks: install mpi4py over MPICH (pip install mpich "
                          "mpi4py) for engine jobs")


class ManualLaunch:
    """hvdrun running ``command`` on the ranks of ``hosts`` ((name, ranks) in rank order)
    through MPICH's manual launcher: :meth:`proxies` gives the command line each host's agent
    must run, :meth:`wait` the job's exit code.

    ``env``: variables the ranks get on top of this process's; ``out``/``err``: streams for
    the ranks' output and hvdrun's messages (default: ours); ``hvdrun_args``: more of its
    flags (--network-interfaces, --prefix-output-with-timestamp); ``horovod``: give the ranks
    the horovod shim (default: when this process imported horovod from it)."""

    def __init__(self, hosts: Sequence[Tuple[str, int]], command: Sequence[str],
                 env: Optional[Dict[str, str]] = None, start_timeout: Optional[float] = None,
                 mpi_args: Sequence[str] = (), out=None, err=None, verbose: bool = False,
                 hvdrun_args: Sequence[str] = (), horovod: Optional[bool] = None):
        self.hosts = [(name, count) for name, count in hosts]
        self._lines: List[str] = []
        self._announced = threading.Event()
        self.messages: List[str] = []  # hvdrun's own lines
        self._folder = tempfile.mkdtemp(prefix="hvd_engine_launch.")  # the guard's to remove
        watched, self._watching = os.pipe()
        size = sum(count for _, count in self.hosts)
        arguments = ["-np", str(size), "-H", ",".join(f"{h}:{n}" for h, n in self.hosts),
                     "--mpi-args=" + " ".join([*protocol.MANUAL_LAUNCHER_ARGUMENTS, *mpi_args])]
        if start_timeout is not None:
            arguments += ["--start-timeout", str(start_timeout)]
        if verbose:
            arguments.append("--verbose")
        arguments += list(hvdrun_args)
        if driver_uses_shim() if horovod is None else horovod:  # a horovod script's ranks
            arguments.append("--horovod")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "hvd_trainer_launch.guard", str(watched), self._folder,
             *arguments, "--", *command],
            env=dict(os.environ, **(env or {})), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(watched,),
            start_new_session=True, cwd="/")  # mpiexec's folder must exist on every host
        os.close(watched)
        self._readers = [
            threading.Thread(target=self._read_stdout, args=(out or sys.stdout.buffer,),
                             daemon=True),
            threading.Thread(target=self._read_stderr, args=(err or sys.stderr.buffer,),
                             daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self, out) -> None:
        """Keep the launcher's proxy lines, show the rest."""
        prefix = protocol.MANUAL_LAUNCH_PREFIX.encode()
        end = protocol.MANUAL_LAUNCH_END.encode()
        for line in iter(self._process.stdout.readline, b""):
            if line.startswith(prefix) and not self._announced.is_set():
                self._lines.append(line[len(prefix):].decode().strip())
            elif line.strip() == end and not self._announced.is_set():
                self._announced.set()
            else:
                _show(out, line)
        self._announced.set()  # hvdrun ended before announcing: proxies() sees no lines

    def _read_stderr(self, err) -> None:
        """Show hvdrun's stderr, keeping its own messages."""
        for line in iter(self._process.stderr.readline, b""):
            if line.startswith(_HVDRUN_MESSAGE):
                self.messages.append(line[len(_HVDRUN_MESSAGE):].decode(errors="replace").strip())
            _show(err, line)

    def proxies(self, timeout: Optional[float] = None) -> List[str]:
        """The proxy command line of each host, in the order of ``hosts``; EngineError when
        hvdrun ends (or ``timeout`` passes) before the launcher printed them all."""
        if not self._announced.wait(timeout):
            self.end()
            raise EngineError(f"mpiexec printed no proxy commands within {timeout:g} s")
        if len(self._lines) != len(self.hosts):
            code = self.wait()
            raise EngineError(
                f"mpiexec -launcher manual printed {len(self._lines)} proxy commands for "
                f"{len(self.hosts)} hosts and hvdrun exited with code {code}: "
                + ("; ".join(self.messages) or "see its output above"))
        return list(self._lines)

    def poll(self) -> Optional[int]:
        """hvdrun's exit code, or None while it runs."""
        return self._process.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for hvdrun (subprocess.TimeoutExpired after ``timeout``) and its output; return
        its exit code."""
        code = self._process.wait(timeout)
        for reader in self._readers:
            reader.join(_KILL_GRACE_SECONDS)
        self._close()
        return code

    def end(self, signum: int = signal.SIGTERM) -> int:
        """Ask hvdrun to end the job (as on ``signum``), SIGKILL it if it lingers; its code."""
        if self._process.poll() is None:
            try:
                self._process.send_signal(signum)
                self._process.wait(_KILL_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.wait()

    def _close(self) -> None:
        if self._watching >= 0:
            os.close(self._watching)
            self._watching = -1
        import shutil
        shutil.rmtree(self._folder, ignore_errors=True)


def driver_uses_shim() -> bool:
    """Whether this process imported ``horovod`` from hvd_trainer's shim (a Horovod script
    whose import was changed): then the ranks get the shim too (hvdrun --horovod)."""
    module = sys.modules.get("horovod")
    origin = getattr(module, "__file__", None)
    return bool(origin) and horovod_shim.is_shim(origin)


def _show(out, data: bytes) -> None:
    """Write ``data`` to ``out``, a binary or text stream; a reader gone is ignored."""
    try:
        out.write(data.decode(errors="replace") if isinstance(out, io.TextIOBase) else data)
        out.flush()
    except (BrokenPipeError, ValueError):
        pass


def rank_layout(hosts: Iterable[str]) -> List[Tuple[str, int]]:
    """The hosts of the agents' slots, one entry per slot, as (host, ranks) in order of first
    appearance: the ranks on one host are consecutive and share local_rank/local_size."""
    counts: Dict[str, int] = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    return list(counts.items())


def payload(func: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: Optional[Dict[str, Any]] = None) -> bytes:
    """(func, args, kwargs) pickled by value (cloudpickle, as Horovod), for the agents."""
    import cloudpickle
    return cloudpickle.dumps((func, tuple(args or ()), dict(kwargs or {})))


def gather(outcomes: Dict[int, bytes], size: int, name: str, hosts: Dict[int, str],
           code: int, messages: Sequence[str], lost: Sequence[str] = (),
           proxies: Sequence[Tuple[str, int, str]] = ()) -> List[Any]:
    """The ranks' results in rank order from the ``outcomes`` that the agents carried back;
    EngineError naming the rank (and host) that raised, the ranks without a result, or the
    agents ``lost``, with hvdrun's ``messages`` and exit ``code``, and what each proxy that
    failed (``proxies``: host, exit code, its messages) said."""
    results, raised, missing = {}, [], []
    for rank in range(size):
        if rank not in outcomes:
            missing.append(rank)
            continue
        try:
            kind, *value = pickle.loads(outcomes[rank])
        except Exception as error:  # e.g. a class this process cannot import
            raise EngineError(f"the result of {name} on rank {rank} cannot be unpickled here: "
                              f"{error}") from error
        if kind == "ok":
            results[rank] = value[0]
        else:
            raised.append((rank, *value))
    said = f"\nhvdrun: {'; '.join(messages)}" if messages else ""
    said += "".join(f"\nthe launcher proxy on {host} exited with code {proxy_code}"
                    + (f": {text.strip()}" if text.strip() else "")
                    for host, proxy_code, text in proxies if proxy_code)
    if raised:
        rank, error, text = raised[0]
        others = [r for r, *_ in raised[1:]]
        also = f" (also on rank{'s' if len(others) > 1 else ''} " \
               f"{', '.join(map(str, others))})" if others else ""
        raise EngineError(f"{name} raised on rank {rank} on host {hosts.get(rank, '?')}{also}:"
                          f"\n{text}{said}") from error
    if lost:
        raise EngineError(f"the agent on {', '.join(lost)} was lost (its executor or actor "
                          f"died) while running {name}; the job was ended{said}")
    if missing or code:
        where = sorted({hosts[r] for r in missing if r in hosts})
        text = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
                f"{' on ' + ', '.join(where) if where else ''} ended without a result; "
                if missing else "")
        raise EngineError(f"{name}: {text}hvdrun exited with code {code}{said}")
    return [results[rank] for rank in range(size)]


def host_of_ranks(layout: Sequence[Tuple[str, int]]) -> Dict[int, str]:
    """Each rank's host under ``layout``."""
    hosts, rank = {}, 0
    for host, count in layout:
        for _ in range(count):
            hosts[rank] = host
            rank += 1
    return hosts


def rank_command(executable: Optional[str] = None) -> List[str]:
    """The command each rank runs: engine_rank under ``executable`` (default: this Python,
    whose path must exist on every host)."""
    return [executable or sys.executable, "-m", "hvd_trainer_launch.engine_rank"]
