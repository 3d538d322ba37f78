"""hvdrun's watch over a life of an elastic job while it runs: the discovery's hosts (another
layout grows the job in place at the ranks' next commit where it can, resizing.py, or restarts
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
                                                  host_of, hosts_text, per_host)
from hvd_trainer_launch.elastic.resizing import Resizer, added_slots, removed_places
from hvd_trainer_launch.elastic.notices import Generation
from hvd_trainer_launch.offers import Growth, Offer, Removal, offer_json
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
                 resizer: Optional[Resizer] = None, resets_left: Optional[int] = None,
                 announce: Optional[Callable[[Hosts], None]] = None,
                 start_timeout: Optional[float] = None):
        super().__init__(daemon=True)
        self.discovery, self.blacklist = discovery, blacklist
        self.layout, self.max_np, self.generation = layout, max_np, generation
        self.relay, self.life, self.clock, self.resizer = relay, life, clock, resizer
        # In an engine's job: told the hosts of a growth in place before the ranks hear of it.
        self.announce = announce
        # How long a growth's new ranks get to start once the launcher has handed out their
        # proxy lines (an engine's job: relay.launch_blocks), and how many blocks came before.
        self.start_timeout, self.blocks_before = start_timeout, 0
        self.growing: Optional[Hosts] = None  # the slots of a growth in place offered
        self.leaving: List[int] = []  # the ranks a removal in place offered leaves out
        self.left: Set[int] = set()  # the ranks that left so
        # How many more resets --reset-limit allows (None: no limit): a change in place counts
        # as one, as in Horovod; past the limit the ranks leave and the restart ends the job.
        self.resets_left = resets_left
        self.in_place = 0  # the changes in place offered in this life
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
            self.check_resized()
            if not self.raised:
                self.check_hosts()

    def started(self) -> int:
        """How many ranks the life has started, those of growths in place included."""
        return sum(slots for _, slots in self.started_on)

    def gone(self) -> List[int]:
        """The ranks of the life no longer in the world: killed (under --ulfm) or left."""
        return [*self.relay.gone_in_place(), *sorted(self.left)]

    def check_resized(self) -> None:
        """Once the ranks of a growth in place offered have begun to start (the relay then
        counts them), they are the life's, its layout has them last; once the ranks a removal
        leaves out have exited, the layout is without them. Then the discovery is watched
        again. New ranks that have not started within the start timeout of the launcher's
        handing out their proxy lines fail the life (the others wait in the spawn)."""
        self.check_growth_started()
        if self.growing is not None and self.relay.np != self.started():
            self.started_on += self.growing
            self.growing = None
            what = "grew"
        elif self.leaving and self.relay.exited.issuperset(self.leaving):
            self.left.update(self.leaving)
            self.leaving = []
            what = "shrank"
        else:
            return
        self.layout = survivors(self.started_on, self.gone())
        say(f"elastic: the job {what} in place to {hosts_text(self.layout)}")
        self.raised = False

    def check_growth_started(self) -> None:
        """Fail the life when a growth's proxy lines were handed out more than the start
        timeout ago and none of its ranks has started (a proxy that cannot reach the
        launcher: Hydra's spawn would wait for it for ever)."""
        blocks = self.relay.launch_blocks[self.blocks_before:]
        if (self.growing is None or self.relay.np != self.started() or not blocks
                or self.start_timeout is None or self.clock() - blocks[0] < self.start_timeout):
            return
        first = self.started()
        self.relay.not_started(list(range(first, first + sum(n for _, n in self.growing))),
                               self.start_timeout)

    def take_lost(self) -> None:
        """Tell the relay of each agent lost in this life, once: a host of a growth in place
        offered too, whose ranks then cannot start (the ranks running would wait in the
        spawn)."""
        for lost in read_lost(self.lost_file, self.life):
            if lost.host not in self.taken:
                self.taken.add(lost.host)
                ranks = ranks_of(self.started_on + (self.growing or []), lost.host)
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
        running = survivors(self.started_on, self.gone())
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
        allowed = self.resets_left is None or self.in_place < self.resets_left
        offer = self.offer(running, found) if self.resizer is not None and allowed else None
        self.in_place += offer is not None
        if isinstance(offer, Growth):
            self.blocks_before = len(self.relay.launch_blocks)
            if self.announce is not None:
                self.announce(self.growing)
        self.generation.changed(b"" if offer is None else offer_json(offer))
        if isinstance(offer, Growth):
            say(f"elastic: hosts changed to {hosts_text(hosts)}; the ranks grow the job in "
                f"place onto {hosts_text(self.growing)} at their next commit")
        elif isinstance(offer, Removal):
            say(f"elastic: hosts changed to {hosts_text(hosts)}; at their next commit "
                f"{self.relay.ranks(self.leaving)} leave the job, the others go on in place")
        else:
            say(f"elastic: hosts changed to {hosts_text(hosts) or 'none'}; the ranks restart "
                "on them at their next commit")

    def offer(self, running: Hosts, found: Hosts) -> Optional[Offer]:
        """The offer that changes the world ``running`` in place to the layout ``found`` (the
        relay told to expect new ranks, or the ranks leaving noted), or None."""
        number = self.generation.number + 1
        added, leaving = added_slots(running, found), removed_places(running, found)
        if added is not None:
            growth = self.resizer.growth(number, self.started(), running, added)
            if growth is not None:
                self.growing = added
                self.relay.expect(added)
            return growth
        if not leaving:
            return None
        gone = set(self.gone())
        world = [rank for rank in range(self.started()) if rank not in gone]
        removal = self.resizer.removal(number, running, leaving,
                                       [self.relay.hosts.get(rank) for rank in world])
        if removal is not None:
            self.leaving = [world[place] for place in leaving]
        return removal

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
