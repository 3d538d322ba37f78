"""hvdrun's watch over a life of an elastic job while it runs: the discovery's hosts (another
layout restarts the job at the ranks' next commit) and, in an elastic engine job
(engines.elastic), the agents the engine lost, whose ranks will neither start nor report: the
life ends at once rather than waiting them out (the start timeout), or, under --ulfm, the
other ranks go on without them and their layout becomes the life's."""
import os
import threading
from typing import Iterable, List, Optional, Set

from hvd_trainer_launch import protocol
from hvd_trainer_launch.elastic.discovery import DISCOVERY_INTERVAL, Discovery, Hosts, allocate, hosts_text
from hvd_trainer_launch.elastic.notices import Generation
from hvd_trainer_launch.elastic.registration import Blacklist, ElasticRelay
from hvd_trainer_launch.job.relay import say


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
    another layout than the life's (:func:`layout_of`: a host added while the life has
    --max-np ranks changes nothing), raises the generation once (the ranks leave at their
    next commit). Under --ulfm, once the hosts are those of the ranks that went on after
    others were killed, that is the life's layout: a host that comes back then grows the job."""

    def __init__(self, discovery: Discovery, blacklist: Blacklist, layout: Hosts,
                 max_np: Optional[int], generation: Generation, relay: ElasticRelay,
                 life: int = 0):
        super().__init__(daemon=True)
        self.discovery, self.blacklist = discovery, blacklist
        self.layout, self.max_np, self.generation = layout, max_np, generation
        self.relay, self.life = relay, life
        self.started_on = list(layout)
        self.lost_file = os.environ.get(protocol.ENGINE_LOST_VARIABLE)
        self.taken: Set[str] = set()  # the lost hosts already taken
        self.raised = False
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(DISCOVERY_INTERVAL):
            self.take_lost()
            if not self.raised:
                self.check_hosts()

    def take_lost(self) -> None:
        """Tell the relay of each agent lost in this life, once."""
        for lost in read_lost(self.lost_file, self.life):
            if lost.host not in self.taken:
                self.taken.add(lost.host)
                ranks = ranks_of(self.started_on, lost.host)
                if ranks:
                    self.relay.agent_lost(ranks, lost.cause, lost.absent)

    def check_hosts(self) -> None:
        """Raise the generation if the usable hosts would give another layout."""
        try:
            hosts = self.blacklist.usable(self.discovery.hosts())
        except ValueError as error:
            if not self.stopped.is_set():  # else stop() killed the script
                say(f"elastic: warning: {error}; keeping the hosts as they are")
            return
        found = sorted(layout_of(hosts, self.max_np))  # not the order
        if found == sorted(self.layout):
            return
        # An engine writes a loss before the hosts without it (engines.elastic.ElasticJob.lost),
        # so a loss that came after run()'s take_lost and before the discovery is read here:
        # read only before, it would look like a host change and restart every rank.
        self.take_lost()
        shrunk = survivors(self.started_on, self.relay.gone_in_place())
        if self.relay.in_place and found == sorted(shrunk):
            self.layout = shrunk
            say(f"elastic: the hosts are those of the ranks that went on ({hosts_text(shrunk)}); "
                "a host that comes back grows the job at their next commit")
            return
        self.generation.number += 1
        self.raised = True
        say(f"elastic: hosts changed to {hosts_text(hosts) or 'none'}; the ranks restart on "
            "them at their next commit")

    def stop(self) -> None:
        self.stopped.set()
        self.discovery.stop()
        self.join()
