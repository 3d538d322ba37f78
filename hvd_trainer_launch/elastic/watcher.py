"""hvdrun's watch over a life of an elastic job while it runs: the discovery's hosts (another
layout grows the job in place at the ranks' next commit where it can, growing.py, or restarts
it there) and, in an elastic engine job
(engines.elastic), the agents the engine lost, whose ranks will neither start nor report: the
life ends at once rather than waiting them out (the start timeout), or, under --ulfm, the
other ranks go on without them and their layout becomes the life's."""
import os
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Set

from hvd_trainer_launch import protocol
from hvd_trainer_launch.elastic.discovery import (DISCOVERY_INTERVAL, Discovery, Hosts, allocate,
                                                  host_of, hosts_text)
from hvd_trainer_launch.elastic.growing import Grower, added_slots
from hvd_trainer_launch.elastic.notices import Generation
from hvd_trainer_launch.growth import Growth, growth_json
from hvd_trainer_launch.elastic.registration import Blacklist, ElasticRelay
from hvd_trainer_launch.job.relay import say

# Under --ulfm, how long the slot of a rank killed in place stays out while the discovery goes
# on listing its host (a rank killed on a host that stays up, e.g. by the OOM killer), before
# the job grows back onto it. Long enough for an engine to report a lost node (Ray takes 2-3 s,
# after which its discovery drops the host), so that the survivors do not restart onto a
# host about to go; short beside a training job's length.
KILLED_SLOT_HOLD_SECONDS = 30.0


def layout_of(hosts: Hosts, max_np: Optional[int]) -> Hosts:
    """The layout a life starts on ``hosts``: every usable slot, at most ``max_np``."""
    np = sum(slots for _, slots in hosts)
    return allocate(hosts, min(np, max_np) if max_np is not None else np)


def ranks_of(layout: Hosts, host: str) -> List[int]:
    """The ranks that ``layout`` places on ``host``."""
    ranks, rank = [], 0
    for name, slots in layout:
        if name == host:
            ranks += range(rank, rank + slots)
        rank += slots
    return ranks


def survivors(layout: Hosts, gone: Iterable[int]) -> Hosts:
    """``layout`` without the slots of the ranks ``gone``; hosts left with none dropped."""
    gone = set(gone)
    left, rank = [], 0
    for host, slots in layout:
        kept = sum(1 for r in range(rank, rank + slots) if r not in gone)
        if kept:
            left.append((host, kept))
        rank += slots
    return left


def per_host(layout: Hosts) -> Dict[str, int]:
    """How many ranks ``layout`` puts on each host (a host may come more than once: a job
    grown in place has its new ranks last)."""
    counts: Dict[str, int] = {}
    for host, ranks in layout:
        counts[host] = counts.get(host, 0) + ranks
    return counts


def read_lost(path: Optional[str], life: int) -> List[protocol.LostHost]:
    """The agents the engine says it lost in ``life`` (its file at ``path``: none without)."""
    if not path:
        return []
    try:
        with open(path, errors="replace") as file:
            text = file.read()
    except FileNotFoundError:
        return []
    return [lost for lost in protocol.parse_lost(text) if lost.life == life]


class HostWatcher(threading.Thread):
    """Every DISCOVERY_INTERVAL during life ``life``: first takes the agents the engine lost
    in it (``relay.agent_lost``), then runs discovery; when the usable hosts would give
    another layout than that of the ranks running (:func:`layout_of`: a host added while the
    life has --max-np ranks changes nothing), raises the generation once (the ranks leave at
    their next commit). Under --ulfm the ranks running are those that went on after others
    were killed: a killed rank's slot is held out for KILLED_SLOT_HOLD_SECONDS, or until the
    discovery lists its host without it (it saw the loss); after that a slot listed there
    grows the job, as a host that comes back does."""

    def __init__(self, discovery: Discovery, blacklist: Blacklist, layout: Hosts,
                 max_np: Optional[int], generation: Generation, relay: ElasticRelay,
                 life: int = 0, clock: Callable[[], float] = time.monotonic,
                 grower: Optional[Grower] = None):
        super().__init__(daemon=True)
        self.discovery, self.blacklist = discovery, blacklist
        self.layout, self.max_np, self.generation = layout, max_np, generation
        self.relay, self.life, self.clock, self.grower = relay, life, clock, grower
        self.growing: Optional[Hosts] = None  # the slots of a growth in place offered
        self.started_on = list(layout)
        self.lost_file = os.environ.get(protocol.ENGINE_LOST_VARIABLE)
        self.taken: Set[str] = set()  # the lost hosts already taken
        # A rank killed in place -> when its slot's hold ends (0: over, or the discovery saw
        # the loss); kept so that a rank's hold begins once.
        self.holds: Dict[int, float] = {}
        self.raised = False
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(DISCOVERY_INTERVAL):
            self.take_lost()
            self.check_grown()
            if not self.raised:
                self.check_hosts()

    def check_grown(self) -> None:
        """Once the ranks of the growth in place offered have begun to start (the relay then
        counts them), they are the life's: its layout has them last, and the discovery is
        watched again."""
        started = sum(slots for _, slots in self.started_on)
        if self.growing is None or self.relay.np == started:
            return
        self.started_on += self.growing
        self.layout = survivors(self.started_on, self.relay.gone_in_place())
        say(f"elastic: the job grew in place to {hosts_text(self.layout)}")
        self.growing = None
        self.raised = False

    def take_lost(self) -> None:
        """Tell the relay of each agent lost in this life, once."""
        for lost in read_lost(self.lost_file, self.life):
            if lost.host not in self.taken:
                self.taken.add(lost.host)
                ranks = ranks_of(self.started_on, lost.host)
                if ranks:
                    self.relay.agent_lost(ranks, lost.cause, lost.absent)

    def check_hosts(self) -> None:
        """Raise the generation if the usable hosts would give another layout than that of
        the ranks running."""
        try:
            discovered = self.discovery.hosts()
        except ValueError as error:
            if not self.stopped.is_set():  # else stop() killed the script
                say(f"elastic: warning: {error}; keeping the hosts as they are")
            return
        # An engine writes a loss before the hosts without it (engines.elastic.ElasticJob.lost),
        # so a loss written while the discovery ran is taken here, after it: taken only before,
        # the host would look gone for no reason under --ulfm and every rank would restart.
        self.take_lost()
        running = survivors(self.started_on, self.relay.gone_in_place())
        hosts = self.without_held(self.blacklist.usable(discovered), running)
        found = layout_of(hosts, self.max_np)
        if per_host(found) == per_host(running):  # not the order
            if per_host(running) != per_host(self.layout):
                self.layout = running
                say(f"elastic: the hosts are those of the ranks that went on "
                    f"({hosts_text(running)}); the job grows at their next commit when a host "
                    f"comes back, or, if the discovery goes on listing the lost ranks' hosts, "
                    f"onto their slots {KILLED_SLOT_HOLD_SECONDS:g} s after the loss")
            return
        self.raised = True
        growth = self.growth(running, found)
        if growth is None:
            self.generation.changed()
            say(f"elastic: hosts changed to {hosts_text(hosts) or 'none'}; the ranks restart "
                "on them at their next commit")
            return
        self.generation.changed(growth_json(growth))
        say(f"elastic: hosts changed to {hosts_text(hosts)}; the ranks grow the job in place "
            f"onto {hosts_text(self.growing)} at their next commit")

    def growth(self, running: Hosts, found: Hosts) -> Optional[Growth]:
        """The offer that grows the ranks ``running`` in place to the layout ``found`` (the
        relay told to expect the new ranks), or None."""
        added = added_slots(running, found) if self.grower is not None else None
        if added is None:
            return None
        first = sum(slots for _, slots in self.started_on)
        growth = self.grower.offer(self.generation.number + 1, first, running, added)
        if growth is not None:
            self.growing = added
            self.relay.expect(added)
        return growth

    def without_held(self, hosts: Hosts, running: Hosts) -> Hosts:
        """``hosts`` less the slots held for ranks killed in place (under --ulfm). A hold
        ends KILLED_SLOT_HOLD_SECONDS after the loss was first seen, or once the discovery
        lists the host with no slot beyond the ranks running there: it saw the loss itself,
        and a slot it lists again after that is a new one."""
        now = self.clock()
        for rank in self.relay.gone_in_place():
            self.holds.setdefault(rank, now + KILLED_SLOT_HOLD_SECONDS)
        room = dict(hosts)  # per host, the slots listed beyond the ranks running there
        for host, slots in running:
            room[host] = room.get(host, 0) - slots
        held: Dict[str, int] = {}
        for rank in sorted(self.holds, key=self.holds.__getitem__, reverse=True):  # newest first
            host = host_of(self.started_on, rank)
            if self.holds[rank] > now and held.get(host, 0) < room.get(host, 0):
                held[host] = held.get(host, 0) + 1
            else:
                self.holds[rank] = 0.0
        return [(host, slots - held.get(host, 0)) for host, slots in hosts
                if slots > held.get(host, 0)]

    def stop(self) -> None:
        self.stopped.set()
        self.discovery.stop()
        self.join()
