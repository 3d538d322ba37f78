"""This rank's commits on disk: the writer thread and the commit store.

:func:`State.commit` (state.py) hands each commit's payload to one background thread
(:data:`writer`), which writes it, signed with the job's secret, into the job's folders
(:class:`CommitStore`); :func:`~.state.run` reads the newest intact one back after a restart.
A rank that ends the job waits a bounded time for its commits in flight to reach the disk.
"""
import concurrent.futures
import errno
import glob
import logging
import os
import shutil
import threading
from typing import Any, Callable, List, Optional, Set, Tuple

from hvd_trainer_launch import protocol
from hvd_trainer_launch.files import signed
from hvd_trainer_launch.protocol import (ELASTIC_DIR_VARIABLE, ELASTIC_DISK_DIR_VARIABLE,
                                         SECRET_VARIABLE)

from ..runtime import files, runtime
from .lives import restarts
from .commits import Commit


log = logging.getLogger("hvd_trainer")
_SUFFIX = ".commit"
# Seconds a rank that ends the job (an uncaught exception) waits for its commits in flight to
# reach the disk, so that the restart begins at its last commit; a stuck disk cannot hold
# the job's end longer.
ABORT_WAIT_SECONDS = 30.0
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


writer = _Writer()


def _finish_writes() -> None:
    """Before a rank ends the job, let its commits in flight reach the disk."""
    writer.wait(ABORT_WAIT_SECONDS)


runtime.at_abort(_finish_writes)


def _commit_number(path: str) -> Optional[int]:
    """The commit number in a commit file's name (``rankR.NUMBER.commit``), or None when the
    name holds none."""
    number = os.path.basename(path)[:-len(_SUFFIX)].rpartition(".")[2]
    return int(number) if number.isdigit() else None


class CommitStore:
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
                    payload = signed.verify(self.secret, f.read(), f"commit file {path!r}")
                Commit.from_payload(payload)
                return number, payload
            except (OSError, ValueError) as error:
                log.warning("rank %d: %s; falling back to the commit before it", runtime.rank(),
                            error)
        return 0, None

    def write_later(self, rank: int, number: int,
                    commit: Commit) -> Optional[concurrent.futures.Future]:
        """Have the background writer write ``commit`` as this rank's commit ``number``."""
        if not self.folders:
            return None
        return writer.submit(self._write, rank, number, commit)

    def _write(self, rank: int, number: int, commit: Commit) -> None:
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
