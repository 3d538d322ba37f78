"""Elastic training (horovod.elastic's API): state that survives the loss of a rank.

An MPI world cannot drop a dead process, so recovery restarts the processes: ``hvdrun
--min-np/--max-np`` ends every rank when one fails or the hosts change and starts them again.
``State.commit()`` writes the state to a file on each rank's local disk (``HVD_ELASTIC_DIR``,
set by hvdrun per job), signed with the job's secret, and :func:`run` restores, on every rank,
the newest intact commit that any rank still holds before it calls the training function
again. Framework adapters subclass
:class:`ObjectState` (see :mod:`hvd_trainer.mxnet.elastic` and
:mod:`hvd_trainer.torch.elastic`).
"""
import abc
import functools
import glob
import logging
import os
import pickle
import socket
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import files, ops, runtime

log = logging.getLogger("hvd_trainer")

# The exit code of a rank that leaves so that hvdrun restarts the job on the new hosts
# (EX_TEMPFAIL: try again). hvdrun treats it as a reset, not as a failure of the host.
RESET_EXIT_CODE = 75
# Variables that hvdrun sets for the ranks in elastic mode.
DIR_VARIABLE = "HVD_ELASTIC_DIR"  # the job's folder for commits on each host's local disk
RESTART_VARIABLE = "HVD_ELASTIC_RESTART"  # how many times the job was restarted before this life
NOTIFY_VARIABLE = "HVD_ELASTIC_NOTIFY"  # host:port where hvdrun tells the hosts' generation
GENERATION_VARIABLE = "HVD_ELASTIC_GENERATION"  # the hosts' generation this life started with
_SUFFIX = ".commit"


class HorovodInternalError(RuntimeError):
    """A collective failed because the job lost a rank. Raised (by the user's code or a
    failing rank) it ends this life of the job: hvdrun restarts it from the last commit."""


class HostsUpdatedInterrupt(RuntimeError):
    """hvdrun found other hosts; raised on every rank at the same ``commit()`` or
    ``check_host_updates()``, so that :func:`run` restarts the job on the new hosts."""


class _HostNotices:
    """Asks hvdrun (on rank 0) whether the hosts changed since this life started.

    hvdrun answers a TCP connection with its current generation number, once the rank has
    proved that it holds the job's secret, and signs the answer with it
    (:func:`hvd_trainer.files.ask_notice`); a number above the one this life started with means
    other hosts. No shared file system is needed, only a route from rank 0's host to the host
    that runs hvdrun.
    """

    def __init__(self, address: Optional[str], generation: int):
        self.address, self.generation = address, generation
        self.secret = files.job_secret()
        self.warned = False

    def changed(self) -> bool:
        if not self.address:
            return False
        host, _, port = self.address.rpartition(":")
        try:
            if self.secret is None:
                raise ValueError(f"{files.SECRET_VARIABLE} is not set")
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                return files.ask_notice(conn, self.secret) > self.generation
        except (OSError, ValueError) as error:
            if not self.warned:
                log.warning("cannot ask hvdrun at %s whether the hosts changed (%s); this "
                            "job will not grow or shrink until it can", self.address, error)
                self.warned = True
            return False


class _CommitStore:
    """This rank's commits in the job's folder on the local disk (0700, refused when another
    user owns it or may write into it): one file per commit, named by rank and commit number,
    signed with the job's secret and written whole (temporary file, fsync, rename). A rank
    keeps its last two commits, so that a damaged newest one falls back to the one before."""

    def __init__(self, folder: Optional[str]):
        self.folder = folder
        self.secret = files.job_secret()
        if folder and self.secret is None:
            raise ValueError(f"{DIR_VARIABLE} is set but {files.SECRET_VARIABLE} is not: "
                             "commits on disk are signed with the job's secret, which hvdrun "
                             "sets; start the job with hvdrun")
        self._checked = False

    def _folder(self) -> str:
        if not self._checked:
            files.private_folder(self.folder)
            self._checked = True
        return self.folder

    def newest(self) -> Tuple[int, Optional[bytes]]:
        """The highest intact commit held on this host (by any rank): its number and data;
        (0, None) when there is none. A commit that fails its signature is skipped with a
        warning naming the file."""
        if not self.folder:
            return 0, None
        found = []
        for path in glob.glob(os.path.join(self._folder(), f"rank*.*{_SUFFIX}")):
            number = os.path.basename(path)[:-len(_SUFFIX)].rpartition(".")[2]
            if number.isdigit():
                found.append((int(number), path))
        for number, path in sorted(found, reverse=True):
            try:
                with open(path, "rb") as f:
                    return number, files.verify(self.secret, f.read(), f"commit file {path!r}")
            except (OSError, ValueError) as error:
                log.warning("rank %d: %s; falling back to the commit before it", runtime.rank(),
                            error)
        return 0, None

    def write(self, rank: int, number: int, data: bytes) -> None:
        """Write commit ``number`` as this rank's file, then remove this rank's commits older
        than the one before it."""
        if not self.folder:
            return
        folder = self._folder()
        files.write_atomically(os.path.join(folder, f"rank{rank}.{number:012d}{_SUFFIX}"),
                               files.sign(self.secret, data))
        for old in glob.glob(os.path.join(folder, f"rank{rank}.*{_SUFFIX}")):
            kept = os.path.basename(old)[:-len(_SUFFIX)].rpartition(".")[2]
            if kept.isdigit() and int(kept) < number - 1:
                os.remove(old)


class State(abc.ABC):
    """State to keep across a reset of the job (horovod.elastic's State).

    Subclasses say what the state is with :meth:`save` (a picklable snapshot; it runs on every
    rank and may use collectives) and :meth:`load`. ``commit()`` and ``check_host_updates()``
    are collectives: every rank calls them at the same point of training.
    """

    def __init__(self) -> None:
        self._reset_callbacks: List[Callable[[], None]] = []
        self._store = _CommitStore(os.environ.get(DIR_VARIABLE) or None)
        self._notices = _HostNotices(os.environ.get(NOTIFY_VARIABLE) or None,
                                     int(os.environ.get(GENERATION_VARIABLE, "0") or 0))
        self._commit_number = 0
        self._committed: Optional[bytes] = None

    @abc.abstractmethod
    def save(self) -> Any:
        """A picklable snapshot of the state (called on every rank)."""

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
        """Snapshot the state, write it to this rank's local disk, then check for new hosts
        (which raises :class:`HostsUpdatedInterrupt`). A collective."""
        self._write(pickle.dumps(self.save(), pickle.HIGHEST_PROTOCOL))
        self.check_host_updates()

    def _write(self, data: bytes) -> None:
        self._commit_number += 1
        self._committed = data
        self._store.write(runtime.rank(), self._commit_number, data)

    def restore(self) -> None:
        """Go back to the last commit (or to the state :func:`run` started with)."""
        if self._committed is None:
            raise ValueError("restore(): nothing committed yet; call it inside a function "
                             "decorated with hvd.elastic.run, or after commit()")
        self.load(pickle.loads(self._committed))

    def sync(self) -> None:
        """Give every rank rank 0's state. A collective."""
        runtime.init()
        data = pickle.dumps(self.save(), pickle.HIGHEST_PROTOCOL)
        if runtime.size() > 1:
            data = ops.broadcast_object(data if runtime.rank() == 0 else None, 0,
                                        name="elastic.sync")
        self._committed = data
        self.load(pickle.loads(data))

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if hvdrun found other hosts
        since this life of the job started. A collective (rank 0 asks, the others follow)."""
        changed = runtime.rank() == 0 and self._notices.changed()
        if runtime.size() > 1:
            changed = ops.broadcast_object(changed, 0, name="elastic.hosts")
        if changed:
            raise HostsUpdatedInterrupt("hvdrun found other hosts; the job restarts on them "
                                        "from this commit")

    def recover(self) -> None:
        """Load the newest commit that any rank holds, from the rank that holds it, on every
        rank; without one, :meth:`sync`. A collective that :func:`run` calls first."""
        runtime.init()
        try:
            number, data = self._store.newest()
            error = None
        except OSError as e:  # the folder is not the job's own: every rank raises it
            number, data, error = 0, None, f"rank {runtime.rank()}: {e}"
        every = ([(number, error)] if runtime.size() == 1 else
                 ops.allgather_object((number, error), name="elastic.commits"))
        error = next((e for _, e in every if e), None)
        if error:
            raise OSError(error)
        holders = [n for n, _ in every]
        newest = max(holders)
        if newest == 0:
            self.sync()
        else:
            root = holders.index(newest)
            if runtime.size() > 1:
                data = ops.broadcast_object(data if runtime.rank() == root else None, root,
                                            name="elastic.restore")
            self._committed = data
            self._commit_number = newest
            self.load(pickle.loads(data))
            log.info("rank %d restored commit %d from rank %d", runtime.rank(), newest, root)
        if int(os.environ.get(RESTART_VARIABLE, "0") or 0) > 0:
            self.on_reset()

    def leave_for_new_hosts(self) -> None:
        """Commit the state as it is (without checking the hosts) and exit with
        RESET_EXIT_CODE, so that hvdrun restarts the job on the new hosts from here."""
        self._write(pickle.dumps(self.save(), pickle.HIGHEST_PROTOCOL))
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
    process exits with RESET_EXIT_CODE for hvdrun to restart the job on the new hosts.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        state.recover()
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            state.leave_for_new_hosts()
    return wrapper


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
