"""State and run(): what survives a reset of the job, and the loop that restores it.

``State.commit()`` snapshots the state (commits.py) and hands it to the writer (store.py);
:func:`run` calls the training function, and after a failure or a host change restores, on
every rank, the newest intact commit that any rank still holds before calling it again (under
``hvdrun --ulfm``, the survivors of a killed rank shrink the world and go on in their
processes instead). Framework adapters subclass :class:`ObjectState`.
"""
import abc
import concurrent.futures
import functools
import io
import logging
import os
import pickle
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hvd_trainer_launch import protocol
from hvd_trainer_launch.offers import LEFT_VARIABLE, Growth, Offer, Removal, read_offer
from hvd_trainer_launch.protocol import (ELASTIC_DIR_VARIABLE, GENERATION_VARIABLE, MIN_NP_VARIABLE,
                                         NOTIFY_VARIABLE, RESET_EXIT_CODE, ULFM_VARIABLE)

from ..runtime import membership, runtime
from ..collectives import joined, objects, ops
from .lives import count_variable, no_commit_found, restarts
from .commits import Commit, Pickler, aligned_empty
from .notices import HostNotices
from .sampler import ElasticSampler
from .store import CommitStore, writer


log = logging.getLogger("hvd_trainer")
class HorovodInternalError(RuntimeError):
    """A collective failed because the job lost a rank. Raised (by the user's code or a
    failing rank) it ends this life of the job: hvdrun restarts it from the last commit."""


class HostsUpdatedInterrupt(RuntimeError):
    """hvdrun found other hosts; raised on every rank at the same ``commit()`` or
    ``check_host_updates()``, so that :func:`run` grows or shrinks the job in place
    (``offer``: hvdrun's) or restarts it on the new hosts (``offer`` None)."""

    def __init__(self, message: str, offer: Optional[Offer] = None):
        super().__init__(message)
        self.offer = offer


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
        self._store = CommitStore(os.environ.get(ELASTIC_DIR_VARIABLE) or None)
        self._notices = HostNotices(os.environ.get(NOTIFY_VARIABLE) or None,
                                     count_variable(GENERATION_VARIABLE), self._store)
        self._commit_number = 0
        self._committed: Optional[Commit] = None
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
        if self._asking.result() is not None:
            return True
        self._asking = None
        return False

    def _answered(self) -> Optional[protocol.Notice]:
        """hvdrun's answer to rank 0's question once it has come, when it tells of other
        hosts (None while it is on its way: a later commit takes it)."""
        asking = self._asking
        if asking is None or not asking.done():
            return None
        self._asking = None
        return asking.result()

    def _take(self, snapshot: Any) -> None:
        """Make ``snapshot`` the last commit: pickled with its arrays copied into the next
        buffer in turn (once the write that used it has ended)."""
        pickled = io.BytesIO()
        pickler = Pickler(pickled)
        pickler.dump(snapshot)
        self._commit_number += 1
        slot = self._commit_number % 2
        buffer, writing = self._buffers[slot]
        if writing is not None:
            concurrent.futures.wait([writing])
        if buffer.nbytes < pickler.size:
            buffer = aligned_empty(pickler.size)
        region = buffer[:pickler.size]
        for kind, obj, (_, offset, nbytes, meta) in pickler.arrays:
            kind.copy(obj, meta, region[offset:offset + nbytes])
        self._committed = Commit(pickled.getvalue(), region)
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
            data = objects.broadcast_object(data if runtime.rank() == 0 else None, 0,
                                            name="elastic.sync")
        self._committed = Commit(data)
        self.load(self._committed.load())

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if hvdrun found other hosts
        since this life of the job started, and OSError if a commit failed to reach the disk
        on some rank since the last check. A collective (rank 0 asks hvdrun, the ranks tell
        each other)."""
        self._check(self._notices.changed() if runtime.rank() == 0 else None)

    def _check(self, notice: Optional[protocol.Notice]) -> None:
        """check_host_updates() with rank 0's answer from hvdrun, ``notice``, at hand."""
        failure = self._store.failure()
        changed = notice is not None
        offer = notice.offer if notice is not None else b""
        if runtime.size() > 1:  # one small exchange; the failures' text only when there is one
            changed, failed = ops.any_rank([changed, failure is not None], "elastic.hosts")
            if failed:
                every = objects.allgather_object(failure, name="elastic.failures")
                failure = next(f for f in every if f)
            if changed:  # rank 0's offer to change in place, if any
                offer = objects.broadcast_object(offer, 0, name="elastic.offer")
        if failure:
            raise OSError(failure)
        if changed and offer:
            raise HostsUpdatedInterrupt("hvdrun found other hosts; the job changes in place "
                                        "from this commit", read_offer(offer))
        if changed:
            raise HostsUpdatedInterrupt("hvdrun found other hosts; the job restarts on them "
                                        "from this commit")

    def recover(self) -> None:
        """Load the newest commit that any rank holds, from the rank that holds it, on every
        rank; without one, :meth:`sync`. A collective that :func:`run` calls first. A rank
        that a growth in place started takes the commit the others hold, as they resume."""
        runtime.init()
        if membership.joined():
            self.resume()
            joined.settle()
            return
        writer.wait()
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
        """After a shrink (hvdrun --ulfm) or a growth in place: load the newest commit that
        any rank holds in memory (a rank may have failed between the survivors' commits; a
        new rank holds none), then run the reset callbacks. A collective."""
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
                 objects.allgather_object(found, name="elastic.commits"))
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
            self._committed = Commit.from_payload(payload)
            self._commit_number = newest
            self.load(self._committed.load())
            log.info("rank %d restored commit %d from rank %d", runtime.rank(), newest, root)

    def grow_in_place(self, growth: Growth) -> None:
        """Commit the state as it is, start the new ranks hvdrun's ``growth`` offers and merge
        them in (the ranks keep their processes), take the offer's generation, and give every
        rank the commit (:meth:`resume`, the new ranks' :meth:`recover`). A collective."""
        self._take(self.save())
        self._write_taken()
        before = runtime.size()
        places = [(place.procs, place.info) for place in growth.places]
        try:
            size = membership.grow(growth.command[0], growth.command[1:], places)
        except Exception as error:  # MPI could not start them (a host out of reach, say)
            log.error("rank %d: could not grow the job in place (%s); leaving for a restart on "
                      "the new hosts", runtime.rank(), error)
            self._exit_written()
        self._notices.generation = growth.generation
        log.warning("rank %d: grew the job in place from %d to %d ranks", runtime.rank(),
                    before, size)
        self.resume()
        joined.settle()  # what the ranks decided in their steps, for the new ranks

    def shrink_in_place(self, removal: Removal) -> None:
        """Commit the state as it is, and leave the ranks that hvdrun's ``removal`` names out
        of the world: they exit with 0, the others take the offer's generation and the
        commit, run the reset callbacks and go on in their processes. A collective."""
        self._take(self.save())
        self._write_taken()
        before, rank = runtime.size(), runtime.rank()
        size = membership.leave_out(removal.leaving)
        if size is None:
            log.warning("rank %d: leaves the job, its slot gone from the hosts", rank)
            os.environ[LEFT_VARIABLE] = "1"
            self._exit_written(0)
        self._notices.generation = removal.generation
        log.warning("rank %d: shrank the job in place from %d to %d ranks", runtime.rank(),
                    before, size)
        self.resume()

    def leave_for_new_hosts(self) -> None:
        """Commit the state as it is (without checking the hosts), wait until it is written,
        and exit with RESET_EXIT_CODE, so that hvdrun restarts the job on the new hosts from
        here."""
        self._take(self.save())
        self._write_taken()
        self._exit_written(together=True)

    def _exit_written(self, code: int = RESET_EXIT_CODE, together: bool = False) -> None:
        """Wait until the last commit is written, then exit with ``code`` (RESET_EXIT_CODE:
        for hvdrun's restart; 0: this rank left the job). ``together``: every rank exits
        here, so MPI_Finalize ends MPI as usual; otherwise a non-zero code leaves at once
        (runtime's exit hook), which under Open MPI a rank connected to it over TCP (a rank a
        growth in place started) may take for a fatal error."""
        writer.wait()
        failure = self._store.failure()
        if failure and code == RESET_EXIT_CODE:
            log.error("%s; the restart begins at the commit before", failure)
        sys.stdout.flush()
        sys.stderr.flush()
        if together:
            raise SystemExit(code)
        sys.exit(code)


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
    ``func`` raises :class:`HostsUpdatedInterrupt`, the state is committed as it is and
    either, when hvdrun offers it (slots only added, or only removed), the ranks grow or
    shrink the job in place, every rank that stays takes that commit and ``func`` is called
    again, or the process exits with RESET_EXIT_CODE for hvdrun to restart the job on the new
    hosts. Under
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
            except HostsUpdatedInterrupt as interrupt:
                offer = interrupt.offer
                # The autotuner's search, step by step, would go out of step on new ranks.
                if offer is None or isinstance(offer, Growth) and runtime.setting("AUTOTUNE"):
                    state.leave_for_new_hosts()  # exits for hvdrun's restart
                elif isinstance(offer, Growth):
                    state.grow_in_place(offer)
                else:
                    state.shrink_in_place(offer)
            except Exception as error:
                if os.environ.get(ULFM_VARIABLE) != "1" or not membership.lost_peer(error):
                    raise
                _shrink(error)
                state.resume()
    return wrapper


def _shrink(error: Exception) -> None:
    """Shrink the job to the survivors of a failed rank (see :func:`run`). When fewer than
    ``--min-np`` survive, exit with RESET_EXIT_CODE instead: hvdrun then restarts the job
    from the last commit, counting the failed rank's failure, not the survivors' exits."""
    before = runtime.size()
    size = membership.shrink()
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
