"""When hvdrun changes a running life of an elastic job in place, and the offer it makes the
ranks (hvd_trainer_launch.offers).

A life grows in place when the discovery adds slots and keeps every running rank's, the new
ranks can reach hvdrun's ports (not while these listen on the loopback only, for a life all
on this machine, and the new hosts are others), and the launcher can start ranks there from
inside the job with the ranks' variables: MPICH's Hydra on any host, Open MPI's mpirun on its
own host only (it gives new ranks its own environment, which is hvdrun's life's, and its
daemons elsewhere lack it). A life shrinks in place when the discovery drops slots and adds
none, at least --min-np ranks stay, the launcher is MPICH's (whose MPI_Finalize, as hvdrun
sets it, lets a leaving rank go at once; Open MPI's waits for every rank) and every rank runs
on this machine (across hosts, the pip wheel's MPICH fails the others' MPI_Finalize later, its
UCX connections to the rank that left reset). In an elastic engine job (engines.elastic),
whose agents run each host's proxy line, a life grows in place under MPICH onto hosts where it
runs no rank yet (Hydra hands the new hosts' proxy lines to the engine, whose agents there run
them; an agent runs one line at a time), and shrinks in place where every rank runs on
hvdrun's machine (as the ranks' wrappers report it: the agents' names are no machine's).
Otherwise the ranks leave at their next commit and the job restarts on the new hosts (and
always with ``HVD_ELASTIC_IN_PLACE=0`` in hvdrun's environment).
"""
import sys
from typing import List, NamedTuple, Optional, Sequence

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.elastic.discovery import Hosts, per_host
from hvd_trainer_launch.offers import (JOINED_FLAG, Growth, Joining, Removal, SpawnPlace,
                                       joining_json, offer_json)

__all__ = ["Resizer", "added_slots", "removed_places", "IN_PLACE_VARIABLE", "WRAPPER"]

# Set to 0 in hvdrun's environment, every change of the hosts restarts the job.
IN_PLACE_VARIABLE = "HVD_ELASTIC_IN_PLACE"

# The rank wrapper, which hvdrun starts on every rank: ``WRAPPER -- command``.
WRAPPER = [sys.executable, "-m", "hvd_trainer_launch.rank.wrapper"]
# Open MPI maps new ranks by slot, onto hosts whose slots the running ranks fill.
_OPEN_MPI_MAPPING = {"PMIX_MAPBY": "slot:OVERSUBSCRIBE"}


def added_slots(running: Hosts, found: Hosts) -> Optional[Hosts]:
    """The slots of ``found`` beyond those of the ranks ``running`` (host, ranks), host by
    host in ``found``'s order; None when ``found`` lacks a running rank's slot or adds none."""
    left = per_host(running)
    added = []
    for host, slots in found:
        kept = min(slots, left.get(host, 0))
        left[host] = left.get(host, 0) - kept
        if slots > kept:
            added.append((host, slots - kept))
    if not added or any(count > 0 for count in left.values()):
        return None
    return added


def removed_places(running: Hosts, found: Hosts) -> Optional[List[int]]:
    """The places in the world (the rank order of ``running``) of the ranks whose slots
    ``found`` lacks, the last ones of each host; None when ``found`` adds a slot or drops
    none."""
    have, want = per_host(running), per_host(found)
    if any(slots > have.get(host, 0) for host, slots in want.items()):
        return None
    excess = {host: ranks - want.get(host, 0) for host, ranks in have.items()}
    slots = [host for host, ranks in running for _ in range(ranks)]
    leaving = []
    for place in range(len(slots) - 1, -1, -1):
        if excess[slots[place]] > 0:
            excess[slots[place]] -= 1
            leaving.append(place)
    return sorted(leaving) or None


class Resizer(NamedTuple):
    """What a life's changes in place need: the launcher's ``flavour``, the user's
    ``command``, the hosts the launcher was started with (``launched_on``), whether hvdrun's
    ports listen on the loopback only (``local``), --min-np, and whether an engine's agents
    run the proxy lines (``engine``)."""

    flavour: str
    command: List[str]
    launched_on: Sequence[str]
    local: bool
    min_np: int = 1
    engine: bool = False

    def growth(self, generation: int, first: int, running: Hosts,
               added: Hosts) -> Optional[Growth]:
        """The offer that grows the world ``running`` (its layout in rank order) by
        ``added`` as the hosts' ``generation``, the first new rank numbered ``first`` (after
        every rank the life started); None where the growth cannot be in place."""
        running_on = {host for host, _ in running}
        if self.engine and (self.flavour != mpi.HYDRA
                            or any(host in running_on for host, _ in added)):
            return None
        for host, _ in added:
            if self.local and not mpi.this_machine(host):
                return None
            if self.flavour == mpi.OPENMPI and not (mpi.this_machine(host)
                                                    and host in self.launched_on):
                return None
        joining = Joining(first, sum(ranks for _, ranks in running), list(running) + list(added),
                          generation)
        if self.flavour == mpi.HYDRA:
            # Hydra takes one host list for a whole spawn (each "host" key replaces the one
            # before): every new rank's host, in their order, one place.
            places = [SpawnPlace(sum(ranks for _, ranks in added), {"hosts": ",".join(
                host for host, ranks in added for _ in range(ranks))})]
        else:
            places = [SpawnPlace(ranks, {"host": host, **_OPEN_MPI_MAPPING})
                      for host, ranks in added]
        growth = Growth(generation, [*WRAPPER, JOINED_FLAG, joining_json(joining), "--",
                                     *self.command], places)
        if len(offer_json(growth)) > protocol.NOTICE_OFFER_BYTES:
            return None
        return growth

    def removal(self, generation: int, running: Hosts, leaving: List[int],
                machines: Sequence[Optional[str]] = ()) -> Optional[Removal]:
        """The offer that leaves the ranks at the world's places ``leaving`` out of the world
        ``running``, as the hosts' ``generation``; None where it cannot be in place. In an
        engine's job the hosts are its agents' names: ``machines``, where each rank of the
        world said it runs (its wrapper's report), must all be this machine."""
        hosts = list(machines) if self.engine else [host for host, _ in running]
        if (self.flavour != mpi.HYDRA or not hosts
                or not all(host and mpi.this_machine(host) for host in hosts)
                or sum(r for _, r in running) - len(leaving) < self.min_np):
            return None
        return Removal(generation, leaving)
