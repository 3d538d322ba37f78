"""The process's place in the job: init/shutdown, ranks and sizes, process sets, the agreed
configuration (read and parsed in config.py; the launcher check is launcher_check.py).

``init()`` picks the backend: MPI when a launcher started this process (hvdrun, mpiexec,
srun), otherwise a size-1 local world, so ``python train.py`` needs no MPI at all. Every
collective calls ``init()`` lazily, and calling it again is harmless.
"""
import atexit
import functools
import logging
import operator
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

from hvd_trainer_launch import installs
from hvd_trainer_launch.protocol import NO_FINALIZE_WAIT_VARIABLES, WORKER_VARIABLE
from ..backends import Communicator
from .config import agree_settings, env, read_settings
from .launcher_check import check_launcher, launched_by_mpi

log = logging.getLogger("hvd_trainer")


class ProcessSet:
    """A subset of ranks that runs collectives among themselves (Horovod's ProcessSet).

    Create it with ranks, register it with :func:`add_process_set` on every rank, then pass
    it as ``process_set=`` to any collective. ``global_process_set`` holds all ranks.
    """

    def __init__(self, ranks: Optional[Iterable[int]] = None):
        self.ranks: Optional[List[int]] = None if ranks is None else _sorted_ranks(ranks)
        self.process_set_id: Optional[int] = None
        self.comm: Optional[Communicator] = None

    def size(self) -> int:
        """Number of ranks in the set."""
        _require_registered(self)
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set; ValueError if it is not a member."""
        return communicator(self).rank

    def included(self) -> bool:
        """Whether this process belongs to the set."""
        _require_registered(self)
        return self.comm is not None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


def _sorted_ranks(ranks: Iterable[Any]) -> List[Any]:
    """``ranks`` sorted, as ints; as given if one is no integer (1.0 and True included), which
    add_process_set then refuses on every rank."""
    given = list(ranks)
    if not any(isinstance(r, bool) for r in given):
        try:
            return sorted(operator.index(r) for r in given)  # ints, NumPy's integers
        except TypeError:
            pass
    return given


global_process_set = ProcessSet()


class _State:
    def __init__(self, world: Communicator, backend: str):
        self.world = world
        self.backend = backend
        self.local, self.cross = world.local_and_cross()
        # One exchange at init: host layout, and the settings every rank must share.
        every = world.allgather_object((self.local.size, read_settings()))
        self.homogeneous = len({local for local, _ in every}) == 1
        self.settings = agree_settings([s for _, s in every], world.rank)
        for comm in (world, self.local, self.cross):
            comm.configure(self.settings["ALLREDUCE_ALGO"], self.settings["RING_THRESHOLD"])
        self.fusion_threshold = self.settings["FUSION_THRESHOLD"]
        self.process_sets: Dict[int, ProcessSet] = {}
        self.next_set_id = 1
        self.stall_check = self.settings["STALL_CHECK_TIME_SECONDS"]
        self.stall_shutdown = self.settings["STALL_SHUTDOWN_TIME_SECONDS"]
        # MPI_THREAD_MULTIPLE, asked of MPI once; a world without MPI has no such limit.
        self.mpi_threads = backend == "mpi" and _mpi_threads_supported()
        self.threads_multiple = backend != "mpi" or self.mpi_threads
        self.watchdog: Optional[Any] = None


def _mpi_threads_supported() -> bool:
    from ..backends import mpi
    return mpi.threads_supported()


_state: Optional[_State] = None
_lock = threading.RLock()


def lock() -> threading.RLock:
    """The lock under which the runtime's state changes (process sets included)."""
    return _lock


def _check_backend() -> None:
    """HVD_BACKEND is unset, mpi or local; anything else is refused before MPI starts."""
    raw = env("BACKEND")
    if raw not in (None, "mpi", "local"):
        raise ValueError(f"HVD_BACKEND={raw!r} is not a backend; use mpi or local, or leave it "
                         "unset (the launcher decides); HVD_GPU_COMMUNICATOR (nccl, mpi or "
                         "auto) chooses how GPU buffers travel")


def _make_world(comm: Any) -> "tuple[Communicator, str]":
    if comm is None and not launched_by_mpi():
        from ..backends.local import LocalCommunicator
        return LocalCommunicator(), "local"
    for name, value in NO_FINALIZE_WAIT_VARIABLES.items():  # read at MPI_Init: set them first
        os.environ.setdefault(name, value)
    try:
        from ..backends import mpi, mpi_world
    except ImportError as e:
        raise RuntimeError(
            "this process was started by an MPI launcher but mpi4py cannot be imported "
            f"({e}); add it with: {installs.MPI4PY.command}") from e
    if comm is None:
        return mpi_world.world(), "mpi"
    return mpi.MPICommunicator(comm), "mpi"


def init(comm: Any = None) -> None:
    """Join the job. ``comm`` may be an mpi4py communicator to run on instead of COMM_WORLD.
    A second call does nothing. (The public ``init``, which also registers process sets, is
    :func:`hvd_trainer.coordination.process_sets.init`.)"""
    with _lock:
        if _state is None:
            _configure_logging()
            _check_backend()
            world, backend = _make_world(comm)
            if comm is None:
                check_launcher(world, backend)
            _start(world, backend)


def _start(world: Communicator, backend: str) -> None:
    """Start the job on ``world`` (hold ``_lock``)."""
    global _state, _last_rank
    _state = _State(world, backend)
    _last_rank = world.rank
    log.debug("rank %d of %d on the %s backend (%s), fusion threshold %d bytes",
              world.rank, world.size, backend, getattr(world, "algorithm", "-"),
              _state.fusion_threshold)
    global_process_set.ranks = list(range(world.size))
    global_process_set.process_set_id = 0
    global_process_set.comm = world
    _state.process_sets[0] = global_process_set
    if world.size > 1 and not _hooks:
        _install_exit_hook()
        _install_abort_hook()
        _hooks.append(True)
    for start in _at_start:
        start(_state)


def restart_on(world: Communicator) -> None:
    """Start the job again on the MPI communicator ``world`` (the same processes, fewer or
    more of them: membership.py), as shutdown() and init() would. Registered process sets
    are gone, as after shutdown()."""
    with _lock:
        shutdown()
        _start(world, "mpi")


# What the modules above the runtime do when the job starts (the stall watchdog, the
# timeline) and when a rank ends it: they register it here when they are imported, so the
# runtime never imports them.
_at_start: List[Callable[["_State"], None]] = []
_at_abort: List[Callable[[], None]] = []
_at_leave: List[Callable[[Communicator], bool]] = []


def at_start(hook: Callable[["_State"], None]) -> None:
    """Call ``hook(state)`` when :func:`init` starts the job."""
    _at_start.append(hook)


def at_abort(hook: Callable[[], None]) -> None:
    """Call ``hook()`` before a rank ends the job (:func:`abort_job`)."""
    _at_abort.append(hook)


def at_leave(hook: Callable[[Communicator], bool]) -> None:
    """Call ``hook(comm)`` for each process set's communicator at :func:`shutdown`; a hook
    returns whether an operation of this rank alone may still be active on it (then the
    communicator is left, not freed)."""
    _at_leave.append(hook)


def _configure_logging() -> None:
    """HVD_LOG_LEVEL (debug, info, warning, error) sets the level of the 'hvd_trainer' logger."""
    level = env("LOG_LEVEL")
    if level is None:
        return
    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"HVD_LOG_LEVEL={level!r} is not a level; use debug, info, warning or error")
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("hvd_trainer %(levelname)s: %(message)s"))
        log.addHandler(handler)


_hooks: List[bool] = []  # [True] once the hooks below are installed (once per process)


def _rank_now() -> Any:
    """This rank's number in the job now (it changes after a shrink), for messages; between
    a shutdown and the next start (a shrink that failed), the number it had last."""
    return _last_rank if _state is None else _state.world.rank


_last_rank: Any = "?"  # the rank of the last start, for messages once the job is shut down


def _install_abort_hook() -> None:
    """An uncaught exception on one rank ends every rank instead of leaving them waiting."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        abort_job(f"uncaught {kind.__name__} on rank {_rank_now()}; ending the job")

    sys.excepthook = hook


def abort_job(message: str, code: int = 1) -> None:
    """Print ``message`` (prefixed 'hvd_trainer: ') and end every rank of the job with ``code``.

    Under hvdrun the rank exits at once (without MPI_Finalize, which would wait for the
    others): the launcher then ends the job, and output that MPI_Abort's kill could overtake
    still arrives. Under any other launcher it calls MPI_Abort.
    """
    for hook in _at_abort:
        hook()
    sys.stderr.write(f"hvd_trainer: {message}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if os.environ.get(WORKER_VARIABLE) or _state is None:
        os._exit(code)
    # MPI_Abort's kill can overtake the message on its way through the launcher's proxy (seen
    # with MPICH's mpiexec under load): give the proxy a moment to forward it.
    time.sleep(_ABORT_DRAIN_SECONDS)
    _state.world.abort(code)


_ABORT_DRAIN_SECONDS = 0.2


# [status, id of its _RankExit] of a sys.exit call on the main thread whose exception has
# not been caught; empty otherwise.
_exit_request: List[Any] = []


class _RankExit(SystemExit):
    """The SystemExit that sys.exit raises in a multi-rank job: it records the exit request
    while it lives, and forgets it if the program catches it."""

    def __init__(self, status: Any):
        super().__init__(status)
        _exit_request[:] = [status, id(self)]

    def __del__(self) -> None:
        # An exception that dies while Python code runs was caught there. The interpreter's
        # top-level handler, which exits with its status, drops it with no Python frame running.
        try:
            sys._getframe(1)
        except ValueError:
            return
        if _exit_request and _exit_request[1] == id(self):
            _exit_request.clear()


def _install_exit_hook() -> None:
    """``sys.exit(n)``, n != 0, on one rank ends every rank with code n (at exit, as abort_job).

    A launcher that does not end the job when one rank fails (MPICH's mpiexec, srun) would
    otherwise leave the other ranks waiting for the one that left. A zero status, or a
    SystemExit that the program catches, changes nothing.
    """
    original = sys.exit

    @functools.wraps(original)
    def exit_rank(status: Any = None) -> None:
        __tracebackhide__ = True  # noqa: F841 (an engine rank's error report leaves it out)
        if threading.current_thread() is not threading.main_thread():
            original(status)  # ends only this thread
        raise _RankExit(status)  # no local name: this frame lives on in the traceback

    def end_job() -> None:
        if not _exit_request:
            return
        status = _exit_request[0]
        code = 0 if status is None else status if isinstance(status, int) else 1
        if code:
            abort_job(f"rank {_rank_now()} called sys.exit({status!r}); ending the job", code)

    sys.exit = exit_rank
    atexit.register(end_job)


def shutdown() -> None:
    """Leave the job: free process sets. MPI itself is finalised by mpi4py at exit."""
    global _state
    with _lock:
        if _state is None:
            return
        if _state.watchdog is not None:
            _state.watchdog.stop()
        for ps in list(_state.process_sets.values()):
            if ps.comm is not None:
                # Calls still pending here fail; a communicator whose round may stay active
                # (this rank's alone) is left, not freed (see Schedule.abandon).
                busy = [hook(ps.comm) for hook in _at_leave]  # every hook runs
                if any(busy):
                    ps.comm.leave()
                elif ps is not global_process_set:
                    ps.comm.free()
            ps.comm, ps.process_set_id = None, None
        _state = None


def is_initialized() -> bool:
    """Whether :func:`init` has run (explicitly or lazily)."""
    return _state is not None


def state() -> _State:
    """The runtime state, initialising lazily."""
    if _state is None:
        init()
    return _state


def rank() -> int:
    """This process's rank in the world."""
    return state().world.rank


def size() -> int:
    """Number of processes in the world."""
    return state().world.size


def local_rank() -> int:
    """Rank among the processes on this host (MPI's shared-memory split)."""
    return state().local.rank


def local_size() -> int:
    """Number of processes on this host."""
    return state().local.size


def cross_rank() -> int:
    """Rank among the processes with this local rank, one per host."""
    return state().cross.rank


def cross_size() -> int:
    """Number of hosts taking part (processes sharing this local rank)."""
    return state().cross.size


def setting(name: str) -> Any:
    """An agreed setting (a key of config.AGREED_SETTINGS): rank 0's value, the same on every rank."""
    return state().settings[name]


def threads_multiple() -> bool:
    """Whether threads may call into the backend concurrently (MPI_THREAD_MULTIPLE)."""
    return state().threads_multiple


def fusion_threshold() -> int:
    """Largest bucket, in bytes, that grouped collectives pack tensors into."""
    return state().fusion_threshold


def mpi_built() -> bool:
    """Whether the MPI backend can run here (mpi4py imports)."""
    try:
        from ..backends import mpi  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled() -> bool:
    """Whether this job runs on MPI (False in a launcher-less size-1 world)."""
    return state().backend == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI was initialised with MPI_THREAD_MULTIPLE (False without MPI; where threads
    may call concurrently in any world, see :func:`threads_multiple`)."""
    return state().mpi_threads


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return state().homogeneous


def gloo_enabled() -> bool:
    """Gloo is not a backend of hvd_trainer."""
    return False


@functools.lru_cache(maxsize=None)
def cuda_built() -> bool:
    """Whether CuPy is installed and sees a CUDA GPU, so ``hvd_trainer.cuda`` can run."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or CuPy's CUDARuntimeError where there is no driver
        return False


def rocm_built() -> bool:
    """ROCm is not supported."""
    return False


def ddl_built() -> bool:
    """IBM DDL is not supported."""
    return False


def gloo_built() -> bool:
    """Gloo is not a backend of hvd_trainer."""
    return False


def nccl_built() -> bool:
    """Whether :func:`cuda_built` and CuPy found an NCCL library to call."""
    if not cuda_built():
        return False
    from ..backends import nccl
    return nccl.available()


def ccl_built() -> bool:
    """oneCCL is not a backend of hvd_trainer."""
    return False


def _require_registered(ps: ProcessSet) -> None:
    state()
    if ps.process_set_id is None:
        raise ValueError(f"{ps!r} is not registered; call add_process_set() on every rank first")


def communicator(ps: ProcessSet) -> Communicator:
    """The communicator behind a process set; ValueError if this rank is not a member."""
    _require_registered(ps)
    if ps.comm is None:
        raise ValueError(f"rank {rank()} is not a part of process set {ps.process_set_id} "
                         f"(ranks {ps.ranks}); call this collective only on its member ranks")
    return ps.comm


def world_rank(comm: Communicator, rank_in_comm: int) -> int:
    """The world rank of ``rank_in_comm`` of a process set's communicator (for messages)."""
    for ps in state().process_sets.values():
        if ps.comm is comm:
            return ps.ranks[rank_in_comm]
    return rank_in_comm
