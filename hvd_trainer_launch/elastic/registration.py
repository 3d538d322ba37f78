"""Elastic mode's record of how each life ended: which ranks failed on their own and which
hosts that counts against (ElasticRelay), and the hosts left out after failing in lives in a
row (Blacklist); Horovod's runner/elastic/registration.py keeps the workers' states there."""
import random
import time
from typing import Callable, Dict, List, Optional, Sequence, Set

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.elastic.discovery import Hosts, host_of
from hvd_trainer_launch.job.relay import ENDED, Failure, first_failure, OutputRelay, say
from hvd_trainer_launch.protocol import RESET_EXIT_CODE

# How a rank ended whose engine agent was lost (ElasticRelay.agent_lost).
LOST_WITH_AGENT = "was lost with its engine agent, code"
FAILED_LIVES_TO_BLACKLIST = 2  # a host out after its ranks failed in this many lives in a row


class Blacklist:
    """Hosts kept out: one whose ranks failed in FAILED_LIVES_TO_BLACKLIST lives in a row stays
    out for a random time in the cooldown range, or for good without one."""

    def __init__(self, cooldown: Optional[Sequence[float]],
                 clock: Callable[[], float] = time.monotonic):
        self.cooldown, self.clock = cooldown, clock
        self.streak: Dict[str, int] = {}
        self.until: Dict[str, float] = {}

    def life_ended(self, used: Sequence[str], failed: Set[str],
                   unsure: Set[str] = frozenset()) -> List[str]:
        """Count the lives in a row in which each used host failed; return the hosts that
        this puts out. A host in ``unsure`` (a rank failed there, maybe as a consequence)
        neither counts a life nor breaks the row."""
        out = []
        for host in used:
            if host in unsure and host not in failed:
                continue
            self.streak[host] = self.streak.get(host, 0) + 1 if host in failed else 0
            if self.streak[host] >= FAILED_LIVES_TO_BLACKLIST:
                self.streak[host] = 0
                wait = random.uniform(*self.cooldown) if self.cooldown else float("inf")
                self.until[host] = self.clock() + wait
                out.append(host)
        return out

    def will_return(self) -> bool:
        """Whether some host now out will come back (after its cooldown)."""
        now = self.clock()
        return any(now < until < float("inf") for until in self.until.values())

    def usable(self, hosts: Hosts) -> Hosts:
        """``hosts`` without those out now."""
        now = self.clock()
        return [(host, slots) for host, slots in hosts if self.until.get(host, 0.0) <= now]

    def why_out(self, host: str) -> str:
        """Why ``host`` is out now, and for how long."""
        left = self.until[host] - self.clock()
        return (f"{host} (its ranks failed in {FAILED_LIVES_TO_BLACKLIST} lives in a row; out "
                + ("for the rest of the job)" if left == float("inf") else f"for {left:.0f} s more)"))


class ElasticRelay(OutputRelay):
    """hvdrun's output relay, whose first failure ends a life of the job, not the job: its
    message says so, and a rank leaving for new hosts (RESET_EXIT_CODE) is no failure. It
    keeps every rank that failed on its own before hvdrun began to end the life (``failed``:
    rank -> exit code); exits after that, or after mpiexec signalled the rank (Open MPI ends
    the others itself), are consequences."""

    def __init__(self, np: int, no_prefix: bool, output_dir: Optional[str],
                 hosts: Hosts = (), in_place: bool = False):
        super().__init__(np, no_prefix, output_dir, hosts)
        self.np = np
        self.failed: Dict[int, int] = {}
        self.in_place = in_place  # --ulfm: the survivors of a killed rank go on without it
        self.absent: Set[int] = set()  # ranks whose agent was gone before this life began
        self.expected: Optional[Hosts] = None  # where an offered growth in place puts ranks

    def expect(self, added: Hosts) -> None:
        """hvdrun offered to grow the job in place by ``added`` (host, ranks): once the first
        new rank starts, the life has them too, numbered from :attr:`np` on."""
        with self._lock:
            self.expected = list(added)

    def deliver(self, report: protocol.Report) -> None:
        if isinstance(report, protocol.Started) and report.rank >= self.np:
            with self._lock:
                added, self.expected = self.expected, None
                if added is not None:
                    self.np += sum(ranks for _, ranks in added)
            if added is not None:
                self.add_ranks(added)
        super().deliver(report)

    def survived(self, least: int) -> bool:
        """Under --ulfm, whether this life ended well: every failure reported was a rank
        killed by a signal (the others shrank and went on without it), at least ``least``
        ranks were left, and none of those reported a failure (they exited with 0)."""
        with self._lock:
            return (self.in_place and bool(self.reported)
                    and all(failure.killed for failure in self.reported)
                    and self.np - len(self.reported) >= least)

    def gone_in_place(self) -> List[int]:
        """Under --ulfm, the ranks killed (or lost with their engine agent) whom the others
        went on without; none otherwise. Not those the launcher ended: it ends every rank when
        it loses a host's daemon, and that life is over."""
        with self._lock:
            return [failure.rank for failure in self.reported
                    if failure.killed and failure.how != ENDED] if self.in_place else []

    def agent_lost(self, ranks: Sequence[int], cause: str, absent: bool = False) -> None:
        """An elastic engine lost the agent of ``ranks`` (``cause``: its words): they will
        neither start nor report. Under --ulfm, when all of them had started, they count as
        killed (the others go on without them); otherwise they fail this life, which ends
        at once (not after the start timeout). ``absent``: the agent was gone before this life
        began, so no host is blamed for it (see :meth:`blamed`)."""
        with self._lock:
            if self.interrupted or self.ending or self.failure is not None:
                return
            ranks = [rank for rank in ranks if rank not in self.exited and rank not in self.failed]
            if not ranks:
                return
            if absent:
                self.absent.update(ranks)
            in_place = self.in_place and all(rank in self.started for rank in ranks)
            failures = [Failure(rank, 1, LOST_WITH_AGENT, killed=in_place) for rank in ranks]
            for failure in failures:
                self.failed[failure.rank] = failure.code
                self.exited.add(failure.rank)  # no report will come
            self.reported.extend(failures)
            if not in_place:
                self.failure = failures[0]
        what = f"the engine lost the agent of {self.ranks(ranks)}" + (f" ({cause})" if cause else "")
        _say(f"{what}; under --ulfm the other ranks go on without "
             f"{'them' if len(ranks) > 1 else 'it'}" if in_place else
             f"{what}; ending this life of the job to restart it from the last commit")

    def blamed(self, layout: Hosts) -> Set[str]:
        """The hosts that this life's end counts against: the host of the rank that failed
        first on its own (first_failure: across hosts the others fail after it, their
        peer gone, through no fault of their hosts). When none failed but some ranks never
        started, the launch failed on their hosts (ssh could not reach them, a name did not
        resolve): those other than this machine, or this one. None when the life ended for an
        agent that was gone before it began: its host was counted in the life it was lost in
        (the engine saw the loss only after hvdrun had read the hosts for this one)."""
        with self._lock:
            own = [failure for failure in self.reported if failure.rank in self.failed
                   and failure.rank not in self.absent
                   and failure.how != ENDED and failure.code != RESET_EXIT_CODE]
            absent = bool(self.absent)
        if own:
            return {host_of(layout, first_failure(own).rank)}
        if absent:
            return set()
        missing = {host_of(layout, rank) for rank in range(self.np) if rank not in self.started}
        return {host for host in missing if not mpi.this_machine(host)} or missing

    def record(self, rank: int, code: int, how: str, at: Optional[float] = None,
               killed: bool = False) -> None:
        with self._lock:
            if self.interrupted or self.ending:
                return
            if code != RESET_EXIT_CODE and how != ENDED:
                self.failed.setdefault(rank, code)
        if self.in_place and killed and how != ENDED:
            _say(f"rank {rank}{self.where([rank])} {how} {code}; under --ulfm the other ranks "
                 "go on without it")
        super().record(rank, code, how, at, killed)

    def announce(self, failure: Failure) -> None:
        if self.in_place and failure.killed and failure.how != ENDED:  # said when recorded
            return
        if failure.code != RESET_EXIT_CODE:
            _say(f"rank {failure.rank}{self.where([failure.rank])} {failure.how} {failure.code}; "
                 "ending this life of the job to restart it from the last commit")


def _say(message: str) -> None:
    say(f"elastic: {message}")
