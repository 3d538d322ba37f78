"""Elastic training (horovod.elastic's API): state that survives the loss of a rank.

An MPI world cannot drop a dead process, so recovery restarts the processes: ``hvdrun
--min-np/--max-np`` ends every rank when one fails or the hosts change and starts them again
(under ``hvdrun --ulfm``, Open MPI's fault-tolerance extensions let the survivors of a killed
rank shrink the world and go on in their processes instead: see :func:`run`).
``State.commit()`` copies the state into memory that the state keeps for its commits, and a
background thread writes that copy to a file in each rank's job folder (``HVD_ELASTIC_DIR``,
set by hvdrun per job, in memory under /dev/shm where the host has it), signed with the
job's secret; :func:`run` restores, on every rank, the newest intact commit that any rank
still holds before it calls the training function again. Framework adapters subclass
:class:`ObjectState` (see :mod:`hvd_trainer.mxnet.elastic` and
:mod:`hvd_trainer.torch.elastic`) and register their tensor types
(:func:`register_array_type`), so that a commit copies tensors instead of pickling them.
"""
import abc
import concurrent.futures
import errno
import functools
import glob
import io
import logging
import os
import pickle
import shutil
import socket
import sys
import threading
import time
from typing import (Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set,
                    Tuple)

import numpy as np

from hvd_trainer_launch import protocol
from hvd_trainer_launch.protocol import (ELASTIC_DIR_VARIABLE, ELASTIC_DISK_DIR_VARIABLE,
                                         GENERATION_VARIABLE, MIN_NP_VARIABLE, NOTIFY_VARIABLE,
                                         RESET_EXIT_CODE, SECRET_VARIABLE,
                                         ULFM_VARIABLE)
from ..runtime import files, runtime
from ..collectives import ops
from .lives import CommitsLostError, count_variable, no_commit_found, restarts

log = logging.getLogger("hvd_trainer")

# Seconds rank 0's whole question to hvdrun may take (connection, exchange).
NOTICE_TIMEOUT = 10.0
_SUFFIX = ".commit"
_ALIGN = 64  # each array of a commit's region starts at a multiple of this many bytes
# Seconds a rank that ends the job (an uncaught exception) waits for its commits in flight to
# reach the disk, so that the restart begins at its last commit; a stuck disk cannot hold
# the job's end longer.
ABORT_WAIT_SECONDS = 30.0


class HorovodInternalError(RuntimeError):
    """A collective failed because the job lost a rank. Raised (by the user's code or a
    failing rank) it ends this life of the job: hvdrun restarts it from the last commit."""


class HostsUpdatedInterrupt(RuntimeError):
    """hvdrun found other hosts; raised on every rank at the same ``commit()`` or
    ``check_host_updates()``, so that :func:`run` restarts the job on the new hosts."""


class _ArrayType(NamedTuple):
    name: str
    describe: Callable[[Any], Optional[Tuple[int, Any]]]
    copy: Callable[[Any, Any, np.ndarray], None]
    rebuild: Callable[[np.ndarray, Any], Any]


_ARRAY_TYPES: Dict[type, _ArrayType] = {}
_ARRAY_NAMES: Dict[str, _ArrayType] = {}


def register_array_type(cls: type, name: str,
                        describe: Callable[[Any], Optional[Tuple[int, Any]]],
                        copy: Callable[[Any, Any, np.ndarray], None],
                        rebuild: Callable[[np.ndarray, Any], Any]) -> None:
    """Let commits copy objects of exactly type ``cls`` (a framework's tensor) into their
    memory instead of pickling them. ``describe(obj)`` gives its size in bytes and what
    ``rebuild`` needs (picklable), or None to pickle ``obj`` as usual; ``copy(obj, meta, out)``
    copies its bytes into ``out``, a uint8 NumPy array of that size; ``rebuild(data, meta)``
    makes a new object from such bytes (``data`` is its own). ``name`` stands for the type
    in the commit."""
    kind = _ArrayType(name, describe, copy, rebuild)
    _ARRAY_TYPES[cls] = _ARRAY_NAMES[name] = kind


def _describe_array(array: np.ndarray) -> Optional[Tuple[int, Any]]:
    # Objects, and the Fortran order that pickle keeps, are pickled as usual.
    if array.dtype.hasobject or array.nbytes == 0 or (
            array.flags.f_contiguous and not array.flags.c_contiguous):
        return None
    return array.nbytes, (array.dtype, array.shape)


def _copy_array(array: np.ndarray, meta: Any, out: np.ndarray) -> None:
    np.copyto(out.view(meta[0]).reshape(meta[1]), array)


register_array_type(np.ndarray, "numpy", _describe_array, _copy_array,
                    lambda data, meta: data.view(meta[0]).reshape(meta[1]))


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _aligned_empty(size: int) -> np.ndarray:
    """``size`` bytes of new memory that start at a multiple of _ALIGN."""
    raw = np.empty(size + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + size]


class _Pickler(pickle.Pickler):
    """Pickles a snapshot with the arrays of registered types left out: each becomes a
    reference (type name, offset, bytes, meta) to its place in the commit's region, and
    :attr:`arrays` lists what to copy there. An array met twice is one reference."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.arrays: List[Tuple[_ArrayType, Any, Tuple[str, int, int, Any]]] = []
        self.size = 0  # bytes of the region
        self._refs: Dict[int, Tuple[str, int, int, Any]] = {}

    def persistent_id(self, obj: Any) -> Optional[Tuple[str, int, int, Any]]:
        kind = _ARRAY_TYPES.get(type(obj))
        if kind is None:
            return None
        ref = self._refs.get(id(obj))
        if ref is None:
            described = kind.describe(obj)
            if described is None:
                return None
            nbytes, meta = described
            ref = self._refs[id(obj)] = (kind.name, self.size, nbytes, meta)
            self.arrays.append((kind, obj, ref))
            self.size += _aligned(nbytes)
        return ref


class _Unpickler(pickle.Unpickler):
    """Loads what :class:`_Pickler` pickled, each array rebuilt (once) from its own copy of
    its bytes in the region."""

    def __init__(self, pickled: Any, region: Any):
        super().__init__(io.BytesIO(pickled))
        self.region = region
        self._made: Dict[int, Any] = {}

    def persistent_load(self, ref: Tuple[str, int, int, Any]) -> Any:
        name, offset, nbytes, meta = ref
        if offset not in self._made:
            kind = _ARRAY_NAMES.get(name)
            if kind is None:
                raise ValueError(f"the commit holds arrays of type {name!r}; import its adapter "
                                 f"(hvd_trainer.{name}) before restoring")
            data = np.frombuffer(self.region, np.uint8, nbytes, offset).copy()
            self._made[offset] = kind.rebuild(data, meta)
        return self._made[offset]


class _Commit:
    """One commit: the pickle of a snapshot and the region that holds its arrays.

    Its payload (what is signed and written) is the pickle, zeros up to a multiple of
    _ALIGN, the region, and the pickle's length in 8 bytes; a payload without arrays is a
    plain pickle followed by that length."""

    def __init__(self, pickled: Any, region: Any = b""):
        self.pickled, self.region = pickled, region

    def parts(self) -> List[Any]:
        """The payload, in pieces (nothing is joined)."""
        length = memoryview(self.pickled).nbytes
        return [self.pickled, bytes(_aligned(length) - length), self.region,
                length.to_bytes(8, "big")]

    @classmethod
    def from_payload(cls, payload: Any) -> "_Commit":
        """The commit of a payload (verified before: it is the job's own); ValueError when
        its layout does not hold together."""
        view = memoryview(payload).cast("B")
        length = int.from_bytes(view[-8:], "big") if view.nbytes >= 8 else -1
        if length < 0 or _aligned(length) > view.nbytes - 8:
            raise ValueError("the commit's layout is damaged")
        return cls(view[:length], view[_aligned(length):view.nbytes - 8])

    def load(self) -> Any:
        return _Unpickler(self.pickled, self.region).load()


class _Writer:
    """The one thread that writes this process's commits, one after the other in the order
    they were made (started on the first commit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._last: Optional[concurrent.futures.Future] = None

    def submit(self, write: Callable[..., None], *args: Any) -> concurrent.futures.Future:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="hvd_trainer-commits")
            self._last = self._executor.submit(write, *args)
            return self._last

    def wait(self, timeout: Optional[float] = None) -> None:
        """Return once every write submitted so far has ended (or after ``timeout`` s)."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last], timeout)


_writer = _Writer()


def _finish_writes() -> None:
    """Before a rank ends the job, let its commits in flight reach the disk."""
    _writer.wait(ABORT_WAIT_SECONDS)


runtime.at_abort(_finish_writes)


class _HostNotices:
    """Asks hvdrun (on rank 0) whether the hosts changed since this life started.

    hvdrun answers a TCP connection with its current generation number, once the rank has
    proved that it holds the job's secret, and signs the answer with it
    (:func:`hvd_trainer_launch.protocol.ask_notice`); a number above the one this life started
    with means other hosts. No shared file system is needed, only a route from rank 0's host
    to the host that runs hvdrun.
    """

    def __init__(self, address: Optional[str], generation: int, store: "_CommitStore"):
        self.address, self.generation, self.store = address, generation, store
        self.secret = protocol.job_secret()
        self.warned = False
        self._asker: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def ask(self) -> concurrent.futures.Future:
        """Start :meth:`changed` on a thread of its own (its answer: the future's result), so
        that the round trip to hvdrun overlaps the caller's work."""
        if self._asker is None:
            self._asker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="hvd_trainer-hosts")
        return self._asker.submit(self.changed)

    def changed(self) -> bool:
        if not self.address:
            return False
        host, _, port = self.address.rpartition(":")
        try:
            if self.secret is None:
                raise ValueError(f"{SECRET_VARIABLE} is not set")
            deadline = time.monotonic() + NOTICE_TIMEOUT
            with socket.create_connection((host, int(port)), timeout=NOTICE_TIMEOUT) as conn:
                told = protocol.ask_notice(conn, self.secret, self.store.written, deadline)
                return told > self.generation
        except (OSError, ValueError) as error:
            if not self.warned:
                log.warning("cannot ask hvdrun at %s whether the hosts changed (%s); this "
                            "job will not grow or shrink until it can", self.address, error)
                self.warned = True
            return False


def _commit_number(path: str) -> Optional[int]:
    """The commit number in a commit file's name (``rankR.NUMBER.commit``), or None when the
    name holds none."""
    number = os.path.basename(path)[:-len(_SUFFIX)].rpartition(".")[2]
    return int(number) if number.isdigit() else None


class _CommitStore:
    """This rank's commits in the job's folders
    (:func:`hvd_trainer_launch.protocol.job_folders`: in memory, and on disk for commits
    that do not fit there), each 0700 and refused when another user owns it or may write into
    it: one file per commit, named by rank and commit number, signed with the job's secret
    and written whole (temporary file, rename) by the background writer. A rank keeps its
    last two commits, so that a damaged newest one falls back to the one before.

    Commits are not fsynced: they serve restarts within the job only, on hosts that are up.
    A killed rank's files stay in the operating system's cache, where the next life reads
    them; a host that crashes takes its ranks, and their commits in /dev/shm, with it
    whatever was synced, and every other host holds its own copy of the same commits (every
    rank writes each one). Files that must outlive the job (checkpoints, ``save_states``)
    are fsynced (:func:`hvd_trainer.runtime.files.write_atomically`).
    """

    def __init__(self, folder: Optional[str]):
        on_disk = os.environ.get(ELASTIC_DISK_DIR_VARIABLE) or None
        self.folders = (protocol.job_folders(folder, on_disk)
                        if folder else ())
        if len(self.folders) > 1 and protocol.memory_root() is None:  # this host lacks /dev/shm
            self.folders = self.folders[1:]
        self.secret = protocol.job_secret()
        if folder and self.secret is None:
            raise ValueError(f"{ELASTIC_DIR_VARIABLE} is set but {SECRET_VARIABLE} is not: "
                             "commits on disk are signed with the job's secret, which hvdrun "
                             "sets; start the job with hvdrun")
        # Temporary files carry the life's number: those of earlier lives are abandoned.
        self.tag = f"life{restarts()}"
        self.written = 0  # the newest commit this rank has written (rank 0 tells hvdrun)
        self._checked: Set[str] = set()
        self._failures: List[str] = []
        self._on_disk_said = False

    def _ready(self, folder: str) -> str:
        """``folder``, made when missing and checked; when another user owns it or may write
        into it, the job's other folder instead (a warning says so, once, and ``folder`` is
        left out from then on), or PermissionError when there is none. A folder removed while
        the job ran is made again, with a warning: the commits it held are gone."""
        if folder in self._checked and not os.path.lexists(folder):
            log.warning("rank %d: the job's commit folder %s was removed while the job ran "
                        "(its commits are lost); making it again", runtime.rank(), folder)
            self._checked.discard(folder)
        if folder not in self._checked:
            try:
                files.private_folder(folder)
            except PermissionError as error:
                others = [other for other in self.folders if other != folder]
                if not others:
                    raise
                log.warning("rank %d: %s; leaving it out and keeping this job's commits in "
                            "%s", runtime.rank(), error, others[0])
                self.folders = tuple(others)
                return self._ready(others[0])
            self._checked.add(folder)
        return folder

    def _write_in(self, folder: str, name: str, parts: List[Any]) -> None:
        """Write a commit's ``parts`` as ``folder/name``, in a folder made again when it was
        removed meanwhile (:meth:`_ready`)."""
        try:
            files.write_signed(os.path.join(self._ready(folder), name), self.secret, parts,
                               sync=False, tag=self.tag)
        except FileNotFoundError:
            if os.path.lexists(folder):
                raise
            files.write_signed(os.path.join(self._ready(folder), name), self.secret, parts,
                               sync=False, tag=self.tag)

    def _existing(self) -> List[str]:
        """The job's folders on this host, checked (the first is made when missing)."""
        return list(dict.fromkeys(self._ready(folder) for i, folder in enumerate(self.folders)
                                  if i == 0 or os.path.lexists(folder)))

    def newest(self) -> Tuple[int, Optional[memoryview]]:
        """The highest intact commit held on this host (by any rank): its number and payload;
        (0, None) when there is none. A commit that fails its signature is skipped with a
        warning naming the file. Temporary files of earlier lives (a rank killed while it
        wrote) are removed."""
        found = []
        for folder in self._existing():
            files.remove_temporaries(folder, f"rank*.*{_SUFFIX}", self.tag)
            for path in glob.glob(os.path.join(folder, f"rank*.*{_SUFFIX}")):
                number = _commit_number(path)
                if number is not None:
                    found.append((number, path))
        for number, path in sorted(found, reverse=True):
            try:
                with open(path, "rb") as f:
                    payload = files.verify(self.secret, f.read(), f"commit file {path!r}")
                _Commit.from_payload(payload)
                return number, payload
            except (OSError, ValueError) as error:
                log.warning("rank %d: %s; falling back to the commit before it", runtime.rank(),
                            error)
        return 0, None

    def write_later(self, rank: int, number: int,
                    commit: _Commit) -> Optional[concurrent.futures.Future]:
        """Have the background writer write ``commit`` as this rank's commit ``number``."""
        if not self.folders:
            return None
        return _writer.submit(self._write, rank, number, commit)

    def _write(self, rank: int, number: int, commit: _Commit) -> None:
        """Write the commit as this rank's file, then remove this rank's commits older than
        the one before it; a failure is kept for :meth:`failure`."""
        parts = commit.parts()
        name = f"rank{rank}.{number:012d}{_SUFFIX}"
        folder = self.folders[0]
        try:
            folder = self._folder_for(sum(memoryview(p).nbytes for p in parts))
            try:
                self._write_in(folder, name, parts)
            except OSError as error:
                if error.errno != errno.ENOSPC or folder == self.folders[-1]:
                    raise
                folder = self._on_disk(f"{folder} is full")
                self._write_in(folder, name, parts)
            self.written = max(self.written, number)
            for kept in self._existing():
                for old in glob.glob(os.path.join(kept, f"rank{rank}.*{_SUFFIX}")):
                    older = _commit_number(old)
                    if older is not None and older < number - 1:
                        os.remove(old)
        except Exception as error:  # kept for the ranks to raise at the next commit
            self._failures.append(f"rank {rank} could not write commit {number} to "
                                  f"{os.path.join(folder, name)!r} ({error}); check that "
                                  "folder's file system (free space, permissions)")

    def _folder_for(self, size: int) -> str:
        """The memory folder while it keeps as much free again after this commit (room for
        the next one, and for MPI's shared memory), else the folder on disk."""
        if len(self.folders) == 1:
            return self.folders[0]
        free = shutil.disk_usage(self._ready(self.folders[0])).free
        if free >= 2 * size:
            return self.folders[0]
        return self._on_disk(f"{self.folders[0]} has {free / 2**20:.0f} MiB free, less than "
                             f"twice the commit's {size / 2**20:.0f} MiB")

    def _on_disk(self, why: str) -> str:
        if not self._on_disk_said:
            log.warning("rank %d: %s; writing commits to %s on disk while it is so",
                        runtime.rank(), why, self.folders[-1])
            self._on_disk_said = True
        return self.folders[-1]

    def failure(self) -> Optional[str]:
        """What went wrong in the earliest write that failed since the last call, or None."""
        return self._failures.pop(0) if self._failures else None


class _HostMessages:
    """Whether hvdrun has told of other hosts, under the private name and method of
    horovod.elastic's State (``state._host_messages.empty()``, a queue of the driver's
    notices there), which Horovod's own elastic test scripts poll on rank 0 while they wait
    for a host change. A notice found here raises HostsUpdatedInterrupt at the next
    ``commit()``."""

    def __init__(self, state: "State"):
        self._state = state

    def empty(self) -> bool:
        """False once hvdrun tells of other hosts than this life started with (rank 0 asks it
        and waits for the answer)."""
        return not self._state._notice_pending()


class State(abc.ABC):
    """State to keep across a reset of the job (horovod.elastic's State).

    Subclasses say what the state is with :meth:`save` (a picklable snapshot; it runs on every
    rank and may use collectives) and :meth:`load`. ``commit()`` and ``check_host_updates()``
    are collectives: every rank calls them at the same point of training.
    """

    def __init__(self) -> None:
        self._reset_callbacks: List[Callable[[], None]] = []
        self._store = _CommitStore(os.environ.get(ELASTIC_DIR_VARIABLE) or None)
        self._notices = _HostNotices(os.environ.get(NOTIFY_VARIABLE) or None,
                                     count_variable(GENERATION_VARIABLE), self._store)
        self._commit_number = 0
        self._committed: Optional[_Commit] = None
        self._asking: Optional[concurrent.futures.Future] = None  # rank 0's question to hvdrun
        self._host_messages = _HostMessages(self)
        # Two buffers for the arrays of commits, used in turn and kept across commits: one
        # holds the last commit (for restore()) while the next is copied into the other.
        self._buffers: List[Tuple[np.ndarray, Optional[concurrent.futures.Future]]] = \
            [(np.empty(0, np.uint8), None), (np.empty(0, np.uint8), None)]

    @abc.abstractmethod
    def save(self) -> Any:
        """A picklable snapshot of the state (called on every rank). Arrays and tensors in
        it may be the live ones: a commit copies them before it returns."""

    @abc.abstractmethod
    def load(self, snapshot: Any) -> None:
        """Set the state from what :meth:`save` returned."""

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after the job was restarted, once the
        state is restored, e.g. to scale the learning rate to the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Snapshot the state into this rank's memory, check for new hosts (which raises
        :class:`HostsUpdatedInterrupt`) and whether an earlier commit failed to reach the disk
        on any rank (which raises OSError naming the rank and the file, on every rank), then
        hand the snapshot to the background writer (to this rank's job folder). A collective.

        Rank 0 asks hvdrun while the snapshot is taken (unless its last question is still
        unanswered) and does not wait for the answer: one that comes after the snapshot
        counts at the first commit after it came, usually the next; every rank raises at the
        same commit all the same. The write starts after the check, once every rank has its
        snapshot, so that it does not compete with the others' copies. A rank killed before
        the write is whole leaves its previous commit in place; a rank that ends the job on
        an exception first finishes the write."""
        if runtime.rank() == 0 and self._notices.address and self._asking is None:
            self._asking = self._notices.ask()
        self._take(self.save())
        try:
            self._check(self._answered())
        finally:
            self._write_taken()

    def _notice_pending(self) -> bool:
        """Ask hvdrun now (or wait for the question under way) whether the hosts changed; a
        yes stays as the answer that the next commit() takes."""
        if not self._notices.address:
            return False
        if self._asking is None:
            self._asking = self._notices.ask()
        if self._asking.result():
            return True
        self._asking = None
        return False

    def _answered(self) -> bool:
        """Whether hvdrun's answer to rank 0's question has come and tells of other hosts
        (False while it is on its way: a later commit takes it)."""
        asking = self._asking
        if asking is None or not asking.done():
            return False
        self._asking = None
        return asking.result()

    def _take(self, snapshot: Any) -> None:
        """Make ``snapshot`` the last commit: pickled with its arrays copied into the next
        buffer in turn (once the write that used it has ended)."""
        pickled = io.BytesIO()
        pickler = _Pickler(pickled)
        pickler.dump(snapshot)
        self._commit_number += 1
        slot = self._commit_number % 2
        buffer, writing = self._buffers[slot]
        if writing is not None:
            concurrent.futures.wait([writing])
        if buffer.nbytes < pickler.size:
            buffer = _aligned_empty(pickler.size)
        region = buffer[:pickler.size]
        for kind, obj, (_, offset, nbytes, meta) in pickler.arrays:
            kind.copy(obj, meta, region[offset:offset + nbytes])
        self._committed = _Commit(pickled.getvalue(), region)
        self._buffers[slot] = (buffer, None)

    def _write_taken(self) -> None:
        """Have the background writer write the last commit :meth:`_take` made."""
        slot = self._commit_number % 2
        self._buffers[slot] = (self._buffers[slot][0], self._store.write_later(
            runtime.rank(), self._commit_number, self._committed))

    def restore(self) -> None:
        """Go back to the last commit (or to the state :func:`run` started with)."""
        if self._committed is None:
            raise ValueError("restore(): nothing committed yet; call it inside a function "
                             "decorated with hvd.elastic.run, or after commit()")
        self.load(self._committed.load())

    def sync(self) -> None:
        """Give every rank rank 0's state. A collective."""
        runtime.init()
        data = pickle.dumps(self.save(), pickle.HIGHEST_PROTOCOL)
        if runtime.size() > 1:
            data = ops.broadcast_object(data if runtime.rank() == 0 else None, 0,
                                        name="elastic.sync")
        self._committed = _Commit(data)
        self.load(self._committed.load())

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if hvdrun found other hosts
        since this life of the job started, and OSError if a commit failed to reach the disk
        on some rank since the last check. A collective (rank 0 asks hvdrun, the ranks tell
        each other)."""
        self._check(runtime.rank() == 0 and self._notices.changed())

    def _check(self, changed: bool) -> None:
        """check_host_updates() with rank 0's answer from hvdrun, ``changed``, at hand."""
        failure = self._store.failure()
        if runtime.size() > 1:  # one small exchange; the failures' text only when there is one
            changed, failed = ops.any_rank([changed, failure is not None], "elastic.hosts")
            if failed:
                every = ops.allgather_object(failure, name="elastic.failures")
                failure = next(f for f in every if f)
        if failure:
            raise OSError(failure)
        if changed:
            raise HostsUpdatedInterrupt("hvdrun found other hosts; the job restarts on them "
                                        "from this commit")

    def recover(self) -> None:
        """Load the newest commit that any rank holds, from the rank that holds it, on every
        rank; without one, :meth:`sync`. A collective that :func:`run` calls first."""
        runtime.init()
        _writer.wait()
        try:
            number, payload = self._store.newest()
            error = None
        except OSError as e:  # the folder is not the job's own: every rank raises it
            number, payload, error = 0, None, f"rank {runtime.rank()}: {e}"
        self._load_newest(number, payload, error, on_none=lambda: no_commit_found(
            runtime.rank(), self._store.folders))
        if restarts() > 0:
            self.on_reset()

    def resume(self) -> None:
        """After a shrink (hvdrun --ulfm): load the newest commit that any survivor holds in
        memory (a rank may have failed between the survivors' commits), then run the reset
        callbacks. A collective of the survivors."""
        committed = self._committed
        payload = None if committed is None else memoryview(b"".join(committed.parts()))
        self._load_newest(self._commit_number if payload is not None else 0, payload, None)
        self.on_reset()

    def _load_newest(self, number: int, payload: Optional[memoryview], error: Optional[str],
                     on_none: Optional[Callable[[], None]] = None) -> None:
        """Every rank loads the newest of the commits the ranks hold (this rank's: commit
        ``number``, ``payload``; ``error``: why it has none), or :meth:`sync` without one,
        after ``on_none()`` (which may raise, on every rank)."""
        found = (number, payload.nbytes if payload is not None else 0, error)
        every = ([found] if runtime.size() == 1 else
                 ops.allgather_object(found, name="elastic.commits"))
        error = next((e for _, _, e in every if e), None)
        if error:
            raise OSError(error)
        holders = [n for n, _, _ in every]
        newest = max(holders)
        if newest == 0:
            if on_none is not None:
                on_none()
            self.sync()
        else:
            root = holders.index(newest)
            if runtime.size() > 1:  # the bytes as they are, without pickling them again
                payload = ops.broadcast(
                    np.frombuffer(payload, np.uint8) if runtime.rank() == root
                    else np.empty(every[root][1], np.uint8), root, name="elastic.restore")
            self._committed = _Commit.from_payload(payload)
            self._commit_number = newest
            self.load(self._committed.load())
            log.info("rank %d restored commit %d from rank %d", runtime.rank(), newest, root)

    def leave_for_new_hosts(self) -> None:
        """Commit the state as it is (without checking the hosts), wait until it is written,
        and exit with RESET_EXIT_CODE, so that hvdrun restarts the job on the new hosts from
        here."""
        self._take(self.save())
        self._write_taken()
        _writer.wait()
        failure = self._store.failure()
        if failure:
            log.error("%s; the restart begins at the commit before", failure)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(RESET_EXIT_CODE)


class ObjectState(State):
    """A state of picklable attributes: ``ObjectState(epoch=0, batch=0)``.

    Attributes given here are saved and restored. An :class:`ElasticSampler`, or an
    instance of a type in ``kept`` (a framework's state lists its models and optimizers
    there), keeps its object, which the script holds elsewhere too: the commit holds its
    ``state_dict()`` and a restore loads that back into it. A sampler's record of processed
    samples is merged over the ranks at each commit.
    """

    kept: Tuple[type, ...] = ()

    def __init__(self, **attributes: Any):
        super().__init__()
        self._names = list(attributes)
        for name, value in attributes.items():
            setattr(self, name, value)

    def save(self) -> Dict[str, Any]:
        snapshot = {}
        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, ElasticSampler):
                value.sync()
            if isinstance(value, (ElasticSampler, *self.kept)):
                value = _StateDictSnapshot(value.state_dict())
            snapshot[name] = value
        return snapshot

    def load(self, snapshot: Dict[str, Any]) -> None:
        for name in self._names:
            value = snapshot[name]
            current = getattr(self, name)
            if (isinstance(value, _StateDictSnapshot)
                    and isinstance(current, (ElasticSampler, *self.kept))):
                current.load_state_dict(value.state)
            else:
                setattr(self, name, value)


class _StateDictSnapshot:
    """A kept object's ``state_dict()`` inside a snapshot, loaded back into the live object."""

    def __init__(self, state: Dict[str, Any]):
        self.state = state


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``func(state, ...)`` (horovod.elastic.run).

    Every rank first restores the newest commit that any rank holds (or rank 0's state on
    the first start), runs the reset callbacks after a restart, then calls ``func``. When
    ``func`` raises :class:`HostsUpdatedInterrupt`, the state is committed as it is and the
    process exits with RESET_EXIT_CODE for hvdrun to restart the job on the new hosts. Under
    ``hvdrun --ulfm``, when ``func`` fails because a rank's process failed, the survivors
    shrink the job to themselves, resume from the newest commit among them and call ``func``
    again, in the same processes (at least ``--min-np`` of them; fewer end this life, and
    hvdrun restarts the job).
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        state.recover()
        while True:
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                state.leave_for_new_hosts()
            except Exception as error:
                if os.environ.get(ULFM_VARIABLE) != "1" or not runtime.lost_peer(error):
                    raise
                _shrink(error)
                state.resume()
    return wrapper


def _shrink(error: Exception) -> None:
    """Shrink the job to the survivors of a failed rank (see :func:`run`). When fewer than
    ``--min-np`` survive, exit with RESET_EXIT_CODE instead: hvdrun then restarts the job
    from the last commit, counting the failed rank's failure, not the survivors' exits."""
    before = runtime.size()
    size = runtime.shrink()
    least = count_variable(MIN_NP_VARIABLE, 1)
    what = (str(error).strip().splitlines() or [type(error).__name__])[0]  # TF's run long
    if size < least:
        log.error("rank %d: %d of %d ranks survived a failed process (%s), fewer than "
                  "--min-np %d; ending this life of the job for a restart", runtime.rank(),
                  size, before, what, least)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(RESET_EXIT_CODE)
    log.warning("rank %d: %d of %d ranks survived a failed process (%s); going on with them "
                "in the same processes", runtime.rank(), size, before, what)


class ElasticSampler:
    """The batches of an epoch for this rank, such that a restart on another number of ranks
    spreads the samples not yet processed over the new ranks: within an epoch every sample is
    processed once, none is lost or repeated (framework-free; a batch sampler, e.g.
    ``gluon.data.DataLoader(dataset, batch_sampler=sampler)``).

    The epoch's order is a permutation of ``range(num_samples)`` fixed by ``seed`` and the
    epoch (or the identity without ``shuffle``). Its unprocessed samples are cut into rounds
    of ``size * batch_size``, and rank r takes every size-th sample of each round from the
    r-th, so every rank gets the same number of batches; a last round with fewer samples than
    ranks joins the round before. Call :meth:`record` with each batch once it is processed,
    and keep the sampler in the committed state (an attribute of the State).
    """

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool = True, seed: int = 0):
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"ElasticSampler(num_samples={num_samples}, batch_size="
                             f"{batch_size}): both must be >= 1")
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch = 0
        self.processed = np.zeros(self.num_samples, bool)
        self._current: Optional[List[List[int]]] = None  # the batches of the running iteration

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: its own order, nothing processed yet."""
        self.epoch = int(epoch)
        self.processed[:] = False

    def order(self) -> np.ndarray:
        """The epoch's order of all samples."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.RandomState((self.seed + self.epoch) % 2**32).permutation(self.num_samples)

    def batches(self, rank: int, size: int) -> List[List[int]]:
        """Rank ``rank``'s batches, of ``size`` ranks, over the samples not processed yet."""
        order = self.order()
        remaining = order[~self.processed[order]]
        span = size * self.batch_size
        rounds = [remaining[start:start + span] for start in range(0, len(remaining), span)]
        if len(rounds) > 1 and len(rounds[-1]) < size:
            rounds[-2:] = [np.concatenate(rounds[-2:])]
        return [[int(i) for i in part[rank::size]] for part in rounds]

    def __iter__(self) -> Iterator[List[int]]:
        runtime.init()
        self._current = self.batches(runtime.rank(), runtime.size())
        return iter(self._current)

    def __len__(self) -> int:
        runtime.init()
        return len(self.batches(runtime.rank(), runtime.size()))

    def record(self, indices: Sequence[int]) -> None:
        """Mark this rank's ``indices`` as processed."""
        self.processed[np.asarray(indices, dtype=np.int64)] = True

    def record_batch(self, batch_index: int) -> None:
        """Mark the ``batch_index``-th batch of the current iteration as processed."""
        if self._current is None or not 0 <= batch_index < len(self._current):
            count = "no iteration has started" if self._current is None else \
                f"the current iteration has {len(self._current)} batches"
            raise ValueError(f"ElasticSampler.record_batch({batch_index}): {count}; pass the "
                             "position of a batch the sampler has handed out")
        self.record(self._current[batch_index])

    def sync(self) -> None:
        """Merge every rank's processed samples (a collective)."""
        runtime.init()
        if runtime.size() > 1:
            merged = ops.allreduce(self.processed.astype(np.uint8), op=ops.Max,
                                   name="elastic.sampler")
            self.processed = merged.astype(bool)

    def state_dict(self) -> Dict[str, Any]:
        """The epoch and the processed samples (packed bits)."""
        return {"epoch": self.epoch, "processed": np.packbits(self.processed)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Set what :meth:`state_dict` returned."""
        self.epoch = int(state["epoch"])
        self.processed = np.unpackbits(state["processed"])[:self.num_samples].astype(bool)
