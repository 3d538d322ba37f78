"""What hvdrun offers the ranks of an elastic job instead of a restart when the hosts change,
and what a rank that joins learns of its place.

When the discovery adds slots and keeps every running rank's, hvdrun offers a
:class:`Growth` with its notice answer (protocol.ask_notice). The ranks take it at the same
commit, start the new ranks through MPI (MPI_Comm_spawn_multiple, one :class:`SpawnPlace` per
host) and merge them in; the running ranks keep their processes. Each new rank's wrapper gets
a :class:`Joining` on its command line (its number, the grown job's layout and generation),
since MPI starts it as rank 0.. of a job of its own. When the discovery drops slots and adds
none, hvdrun offers a :class:`Removal`: the ranks on the slots gone leave the world, the
others go on in their processes.

They travel as JSON, read only after the signature over them checks out (protocol.py), and
are checked field by field here.
"""
import json
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple, Union

__all__ = ["Growth", "Joining", "Offer", "Removal", "SpawnPlace", "joining_json",
           "offer_json", "read_joining", "read_offer", "JOINED_FLAG", "LEFT_VARIABLE"]

# The rank wrapper's flag before the Joining's JSON: ``wrapper --joined JSON -- command``.
JOINED_FLAG = "--joined"
# A rank that a Removal leaves out sets this in its own environment ("1") before it exits, so
# that an engine's rank (engines.rank) says it left rather than returning a result.
LEFT_VARIABLE = "HVD_ELASTIC_LEFT"

Hosts = List[Tuple[str, int]]


class SpawnPlace(NamedTuple):
    """Where a growth starts new ranks: ``procs`` processes with MPI's spawn ``info`` keys
    (the host, and how the launcher finds it)."""

    procs: int
    info: Dict[str, str]


class Growth(NamedTuple):
    """hvdrun's offer to grow the job in place: the ranks take ``generation`` as theirs once
    grown, and start ``command`` (the rank wrapper, told its place, then the user's command)
    on ``places``, the new ranks in their order. The launcher gives the new ranks the
    variables it gave the others (MPICH's Hydra passes the launch's; Open MPI's mpirun, its
    own environment, so it grows only on its own host)."""

    generation: int
    command: List[str]
    places: List[SpawnPlace]


class Removal(NamedTuple):
    """hvdrun's offer to shrink the job in place: the ranks take ``generation`` as theirs, and
    the ranks ``leaving`` (their places in the world) exit once the others have split the
    world without them."""

    generation: int
    leaving: List[int]


Offer = Union[Growth, Removal]


class Joining(NamedTuple):
    """What a new rank's wrapper is told: ``first``, the number hvdrun gives the first new
    rank (for its reports and output lines; the ranks it started earlier in the life keep
    theirs), ``world_first``, the first new rank's place in the grown world (the running
    ranks come first), ``world``, the grown world's layout in rank order (host, ranks), and
    the hosts' ``generation`` it started with."""

    first: int
    world_first: int
    world: Hosts
    generation: int


def offer_json(offer: Offer) -> bytes:
    """``offer`` as the notice answer carries it (:func:`read_offer` reads it back)."""
    if isinstance(offer, Removal):
        return json.dumps({"generation": offer.generation, "leaving": offer.leaving}).encode()
    return json.dumps({"generation": offer.generation, "command": offer.command,
                       "places": [[p.procs, p.info] for p in offer.places]}).encode()


def joining_json(joining: Joining) -> str:
    """``joining`` as the wrapper's command line carries it (:func:`read_joining`)."""
    return json.dumps({"first": joining.first, "world_first": joining.world_first,
                       "world": joining.world, "generation": joining.generation})


def _whole(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} is not a whole number >= 0: {value!r}")
    return value


def _strings(value: Any, what: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{what} is not a list of strings: {value!r}")
    return value


def _hosts(value: Any, what: str) -> Hosts:
    if not isinstance(value, list) or not all(
            isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
            and type(item[1]) is int and item[1] > 0 for item in value):
        raise ValueError(f"{what} is not a list of [host, ranks]: {value!r}")
    return [(host, ranks) for host, ranks in value]


def _fields(text: Any, names: Sequence[str], what: str) -> Dict[str, Any]:
    try:
        found = json.loads(text)
    except ValueError:
        raise ValueError(f"{what} is not JSON: {text!r:.200}") from None
    return _exactly(found, names, what, text)


def _exactly(found: Any, names: Sequence[str], what: str, text: Any) -> Dict[str, Any]:
    if not isinstance(found, dict) or sorted(found) != sorted(names):
        raise ValueError(f"{what} must have exactly the fields {', '.join(names)}: {text!r:.200}")
    return found


def read_offer(data: bytes) -> Offer:
    """The offer in ``data`` (:func:`offer_json`); ValueError naming what is malformed."""
    try:
        parsed = json.loads(data)
    except ValueError:
        raise ValueError(f"hvdrun's offer is not JSON: {data!r:.200}") from None
    if isinstance(parsed, dict) and "leaving" in parsed:
        found = _exactly(parsed, ("generation", "leaving"), "hvdrun's removal offer", data)
        leaving = found["leaving"]
        if not isinstance(leaving, list) or not leaving or not all(
                type(rank) is int and rank >= 0 for rank in leaving):
            raise ValueError(f"the removal offer's leaving ranks are not whole numbers: "
                             f"{leaving!r:.200}")
        return Removal(_whole(found["generation"], "the removal offer's generation"), leaving)
    found = _exactly(parsed, ("generation", "command", "places"), "hvdrun's growth offer", data)
    places = found["places"]
    if not isinstance(places, list) or not places or not all(
            isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] > 0
            and isinstance(p[1], dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in p[1].items())
            for p in places):
        raise ValueError(f"the growth offer's places are not [[processes, {{key: value}}], "
                         f"...]: {places!r:.200}")
    command = _strings(found["command"], "the growth offer's command")
    if not command:
        raise ValueError("the growth offer's command is empty")
    return Growth(_whole(found["generation"], "the growth offer's generation"), command,
                  [SpawnPlace(procs, info) for procs, info in places])


def read_joining(text: str) -> Joining:
    """The Joining in ``text`` (:func:`joining_json`); ValueError naming what is malformed."""
    found = _fields(text, ("first", "world_first", "world", "generation"), f"{JOINED_FLAG}")
    return Joining(_whole(found["first"], f"{JOINED_FLAG}'s first"),
                   _whole(found["world_first"], f"{JOINED_FLAG}'s world_first"),
                   _hosts(found["world"], f"{JOINED_FLAG}'s world"),
                   _whole(found["generation"], f"{JOINED_FLAG}'s generation"))
