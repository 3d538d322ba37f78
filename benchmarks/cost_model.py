"""A cost model of the gradient exchange at 8 to 4,096 ranks, from constants measured here.

Run:  python benchmarks/cost_model.py measure CONSTANTS.json [--no-bed]   (the bed needs root)
      python benchmarks/cost_model.py project CONSTANTS.json [--ranks-per-host 8]
      python benchmarks/cost_model.py nccl [--host-us 60 15]   (NCCL on GPUs: nccl_model.py)

``measure`` times, and writes to CONSTANTS.json with the machine, the date and the commit:

* on this host, 2 and 3 ranks (hvdrun, ``HVD_ALLREDUCE_ALGO=ring``): at tiny sizes our ring
  allreduce called directly, the whole ``allreduce_``, its agreement alone and a raw mpi4py
  ``Sendrecv`` of the ring's chunk around the same ring, so the ring's fixed cost per step is
  ring / 2(N-1) - Sendrecv; a raw persistent ``Allreduce`` of the agreement's record; on 2
  ranks a ping-pong at 8 B..64 MiB (the shared-memory link) and ``Gather`` and ``Bcast`` of
  16 MiB (the hierarchical allreduce's host steps); at 1 and 16 MiB the ring, as checks;
* in one process, then in two at once: NumPy's sum (the ring's reduce), each packed codec's
  encode and decode of a 100 MB float32 gradient, PowerSGD's compute for 25 matrices of
  1000 x 1000 at rank 4 (its own code, at world size 1);
* on the 2-host test bed (tests/multihost/testbed.py), on the bare veth link and under tc tbf
  at 10 and 1 Gbit/s (slow_link.shape): a 2-rank ping-pong over lan0 at 8 B..64 MiB, fitted
  to t = alpha + n * beta (see fit_link), and as checks the 100 MB ring, the agreement,
  PowerSGD and 2-bit across the link; at 10 and 1 Gbit/s the 2 x 2 job of
  benchmarks/hierarchical.py (hierarchical against flat ring, 100 MB).

``project`` needs no MPI: from the constants, for N = 8..4,096 ranks (``--ranks-per-host``
per host, a power of two), per link, it prints markdown tables of the time to sum a 100 MB
float32 gradient by the flat ring, the hierarchical allreduce, PowerSGD and the packed codecs;
the agreement's cost and its share of a step; the packed codecs' memory; and the model's
predictions against every case that ``measure`` timed. The formulas and their assumptions are
in docs/scaling.md.
"""
import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from hvd_trainer.backends.local import LocalCommunicator
from hvd_trainer.coordination import records
from hvd_trainer.runtime.config import DEFAULT_RING_THRESHOLD

# The measuring code imports its neighbours in benchmarks/ (the script's folder, first on
# sys.path when it runs) where it needs them, so that the model imports without them.
HERE = os.path.dirname(os.path.abspath(__file__))

GRADIENT_BYTES = 100_000_000  # the gradient the projections sum: 25 M float32
POWERSGD_MATRICES, POWERSGD_SIDE, POWERSGD_RANK = 25, 1000, 4  # the same 100 MB as matrices
CODECS = {"2-bit": {"type": "2bit", "threshold": 0.5}, "1-bit": {"type": "1bit", "threshold": 0.0},
          "top-k 0.01": {"type": "topk", "ratio": 0.01}}
TINY = (64, 1024, 16384)  # bytes of the ring's fixed-cost sizes
CHECKED = (1 << 20, 16 << 20)  # bytes of the ring's checks on one host
PING_PONG = (8, 1024, 65536, 1 << 20, 16 << 20, 64 << 20)
LINKS = ("bare veth", "10gbit", "1gbit")
RANKS = tuple(2 ** k for k in range(3, 13))  # 8..4096
# MPICH 5.0.2's selection for (i)allgather(v), from the table its library carries: recursive
# doubling for a power-of-two size below 512 KiB in all, Bruck below 80 KiB, else the ring.
_DOUBLING_TOTAL, _BRUCK_TOTAL = 524288, 81920
# and for MPI_Bcast: binomial below 8 ranks or up to 12 KiB, then scatter and an allgather
_BCAST_BINOMIAL_BYTES, _BCAST_SMALL_RANKS = 12288, 8


# -- the constants ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link: t = alpha + bytes * beta (seconds, seconds per byte)."""

    alpha: float
    beta: float


@dataclasses.dataclass(frozen=True)
class Host:
    """What one host does for itself: its shared-memory link, MPI_Gather's and MPI_Bcast's
    seconds per byte there (from 2 ranks), and NumPy's sum in seconds per byte of output."""

    shm: Link
    gather_beta: float
    bcast_beta: float
    reduce_beta: float


@dataclasses.dataclass(frozen=True)
class Ring:
    """Our ring's Python: ``step`` seconds per Sendrecv step beyond the raw Sendrecv, and
    ``call`` seconds per allreduce beyond its agreement and its ring."""

    step: float
    call: float


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The agreement's Python: ``fixed`` seconds per exchange beyond the raw allreduce of its
    record (it reads one reduced record, whatever the number of ranks)."""

    fixed: float


@dataclasses.dataclass(frozen=True)
class Codec:
    """A packed codec: encode and decode seconds per byte of float32 input, and its payload's
    bytes per byte of float32 input."""

    encode: float
    decode: float
    wire: float


@dataclasses.dataclass(frozen=True)
class Constants:
    """Everything the model takes, as ``measure`` wrote it."""

    host: Host
    ring: Ring
    agreement: Agreement
    codecs: Dict[str, Codec]
    powersgd_compute: float  # seconds per step for the 25 x 1000 x 1000 gradient at rank 4
    links: Dict[str, Link]

    @classmethod
    def from_json(cls, data: dict, key: str = "constants") -> "Constants":
        """The constants ``measure`` wrote under ``key``: "constants" (compute timed in one
        process), or "busy_constants" (the slower of two processes timed at once)."""
        c = data[key]
        host = c["host"]
        return cls(host=Host(Link(**host["shm"]), host["gather_beta"], host["bcast_beta"],
                             host["reduce_beta"]),
                   ring=Ring(**c["ring"]), agreement=Agreement(**c["agreement"]),
                   codecs={k: Codec(**v) for k, v in c["codecs"].items()},
                   powersgd_compute=c["powersgd_compute"],
                   links={k: Link(**v) for k, v in c["links"].items()})


# -- the model: pure functions ---------------------------------------------------------------
class _Claimed(LocalCommunicator):
    """A communicator that only claims ``size`` ranks, to size the agreement's records."""

    def __init__(self, size: int):
        self.size = size


def record_bytes(ranks: int) -> int:
    """Bytes of each rank's agreement record on ``ranks`` ranks: records.py's own buffers."""
    return int(records.Records(_Claimed(ranks)).send.nbytes)


class Algorithm(NamedTuple):
    """An MPI collective's algorithm and its number of rounds."""

    name: str
    rounds: int


def allgather_algorithm(ranks: int, total: int) -> Algorithm:
    """MPICH's (i)allgather(v) algorithm for ``ranks`` ranks gathering ``total`` bytes."""
    if ranks & (ranks - 1) == 0 and total < _DOUBLING_TOTAL:
        return Algorithm("recursive doubling", int(math.log2(ranks)))
    if ranks & (ranks - 1) and total < _BRUCK_TOTAL:
        return Algorithm("Bruck", math.ceil(math.log2(ranks)))
    return Algorithm("ring", ranks - 1)


def _hosts(ranks: int, per_host: int) -> int:
    return max(1, ranks // per_host)


def allgather_seconds(ranks: int, each: float, *, per_host: int, host: Link, link: Link) -> float:
    """An MPI allgather of ``each`` bytes per rank. The ring crosses each host's link once per
    step; in recursive doubling and Bruck the rounds within a host go at the host's speed and
    the others cross the link with all ``per_host`` ranks of a host sending at once."""
    algorithm = allgather_algorithm(ranks, int(each * ranks))
    local = min(per_host, ranks)
    if _hosts(ranks, per_host) == 1:
        return algorithm.rounds * host.alpha + (ranks - 1) * each * host.beta
    if algorithm.name == "ring":
        return algorithm.rounds * (link.alpha + each * link.beta)
    inside = int(math.log2(local))
    return (inside * host.alpha + (local - 1) * each * host.beta
            + (algorithm.rounds - inside) * link.alpha
            + (ranks - local) * each * local * link.beta)


def ring_seconds(ranks: int, nbytes: float, *, link: Link, ring: Ring,
                 reduce_beta: float) -> float:
    """Our ring allreduce (backends/mpi.py): 2(N-1) steps, each a Sendrecv of nbytes/N over the
    slowest hop and our Python, and a NumPy sum of each received chunk in the first half."""
    if ranks == 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return (steps * (link.alpha + ring.step) + steps / ranks * nbytes * link.beta
            + (ranks - 1) / ranks * nbytes * reduce_beta)


def bcast_seconds(ranks: int, nbytes: float, *, alpha: float, beta: float) -> float:
    """MPICH's MPI_Bcast: binomial below 8 ranks or for small messages, else a scatter and an
    allgather (recursive doubling up to 512 KiB on a power of two, the ring beyond)."""
    if ranks == 1:
        return 0.0
    tree = math.ceil(math.log2(ranks))
    if ranks < _BCAST_SMALL_RANKS or nbytes <= _BCAST_BINOMIAL_BYTES:
        return tree * (alpha + nbytes * beta)
    doubling = ranks & (ranks - 1) == 0 and nbytes <= _DOUBLING_TOTAL
    return ((tree + (tree if doubling else ranks - 1)) * alpha
            + 2 * (ranks - 1) / ranks * nbytes * beta)


def hierarchical_seconds(ranks: int, nbytes: float, *, per_host: int, host: Host, link: Link,
                         ring: Ring) -> float:
    """backends/hierarchical.py: MPI_Gather of the host's buffers to its first rank and a NumPy
    sum there, our ring among the hosts' first ranks, MPI_Bcast within the host."""
    local, hosts = min(per_host, ranks), _hosts(ranks, per_host)
    inside = 0.0
    if local > 1:
        inside = (math.ceil(math.log2(local)) * host.shm.alpha
                  + (local - 1) * nbytes * (host.gather_beta + host.reduce_beta)
                  + bcast_seconds(local, nbytes, alpha=host.shm.alpha, beta=host.bcast_beta))
    return inside + ring_seconds(hosts, nbytes, link=link, ring=ring,
                                 reduce_beta=host.reduce_beta)


def native_allreduce_seconds(ranks: int, nbytes: float, *, itemsize: int, per_host: int,
                             host: Host, link: Link) -> float:
    """MPICH's MPI_Allreduce on a job of several hosts (its node-aware composition): a binomial
    reduce within each host, recursive doubling (fewer elements than ranks) or reduce-scatter
    and allgather among the hosts, a broadcast within each host."""
    local, hosts = min(per_host, ranks), _hosts(ranks, per_host)
    total = 0.0
    if local > 1:
        total += math.ceil(math.log2(local)) * (host.shm.alpha
                                                + nbytes * (host.shm.beta + host.reduce_beta))
        total += bcast_seconds(local, nbytes, alpha=host.shm.alpha, beta=host.bcast_beta)
    if hosts > 1:
        rounds = math.ceil(math.log2(hosts))
        if nbytes // itemsize < 2 ** int(math.log2(hosts)):
            total += rounds * (link.alpha + nbytes * (link.beta + host.reduce_beta))
        else:
            share = (hosts - 1) / hosts * nbytes
            total += 2 * rounds * link.alpha + 2 * share * link.beta + share * host.reduce_beta
    return total


def factor_bytes(*, matrices: int, side: int, rank: int) -> int:
    """Bytes of PowerSGD's P (or Q) for ``matrices`` float32 matrices side x side."""
    return matrices * side * rank * 4


def allreduce_seconds(ranks: int, nbytes: float, *, per_host: int, host: Host, link: Link,
                      ring: Ring) -> float:
    """Our allreduce's data phase under HVD_ALLREDUCE_ALGO=auto: MPI's below the ring
    threshold, our ring from it."""
    if nbytes < DEFAULT_RING_THRESHOLD:
        return native_allreduce_seconds(ranks, nbytes, itemsize=4, per_host=per_host,
                                        host=host, link=link)
    return ring_seconds(ranks, nbytes, link=link, ring=ring, reduce_beta=host.reduce_beta)


def powersgd_seconds(ranks: int, *, per_host: int, constants: Constants, link: Link) -> float:
    """PowerSGD on the 25 x 1000 x 1000 gradient at rank 4 (collectives/powersgd.py): its
    measured compute and two allreduces, of the P's and of the Q's, with their calls."""
    pq = factor_bytes(matrices=POWERSGD_MATRICES, side=POWERSGD_SIDE, rank=POWERSGD_RANK)
    one = allreduce_seconds(ranks, pq, per_host=per_host, host=constants.host, link=link,
                            ring=constants.ring)
    return constants.powersgd_compute + 2 * (one + constants.ring.call)


def packed_seconds(ranks: int, nbytes: float, *, codec: Codec, per_host: int, host: Link,
                   link: Link, call: float) -> float:
    """A packed codec (collectives/feedback.py): encode once, an allgatherv of every rank's row
    count and one of the payloads, decode every rank's payload."""
    payload = nbytes * codec.wire
    gather = (allgather_seconds(ranks, 8, per_host=per_host, host=host, link=link)
              + allgather_seconds(ranks, payload, per_host=per_host, host=host, link=link))
    return nbytes * codec.encode + gather + ranks * nbytes * codec.decode + call


def packed_memory_bytes(ranks: int, nbytes: float, *, codec: Codec) -> float:
    """Bytes each rank receives into for a packed codec's allgather: every rank's payload."""
    return ranks * nbytes * codec.wire


def agreement_seconds(ranks: int, *, per_host: int, agreement: Agreement, host: Host,
                      link: Link) -> float:
    """One agreement (coordination/agreement.py): its Python and an allreduce of every rank's
    record (digest and complement, state, flags, or-ed), whose size does not grow with the
    ranks."""
    return agreement.fixed + native_allreduce_seconds(ranks, record_bytes(ranks), itemsize=8,
                                                      per_host=per_host, host=host, link=link)


def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> Link:
    """t = alpha + n * beta through (size, seconds) points: the line through the smallest
    message's point whose slope fits the others by least squares (so the large messages set
    beta, and alpha is the small message's time)."""
    n0, t0 = min(zip(sizes, seconds))
    beta = (sum((n - n0) * (t - t0) for n, t in zip(sizes, seconds))
            / sum((n - n0) ** 2 for n in sizes))
    return Link(alpha=t0 - n0 * beta, beta=beta)


class Mechanisms(NamedTuple):
    """Seconds to sum the gradient by each mechanism at one rank count and link."""

    ring: float
    hierarchical: float
    powersgd: float
    packed: Dict[str, float]

    def every(self) -> Dict[str, float]:
        return {"ring": self.ring, "hierarchical": self.hierarchical,
                "PowerSGD": self.powersgd, **self.packed}

    def best(self) -> str:
        times = self.every()
        return min(times, key=times.get)


def mechanisms(ranks: int, *, per_host: int, constants: Constants, link: Link,
               nbytes: float = GRADIENT_BYTES) -> Mechanisms:
    """Every mechanism's seconds for ``nbytes`` of float32 gradient on ``ranks`` ranks."""
    host = constants.host
    one_host = _hosts(ranks, per_host) == 1  # then our ring runs over shared memory too
    return Mechanisms(
        ring=ring_seconds(ranks, nbytes, link=host.shm if one_host else link,
                          ring=constants.ring, reduce_beta=host.reduce_beta) + constants.ring.call,
        hierarchical=hierarchical_seconds(ranks, nbytes, per_host=per_host, host=host, link=link,
                                          ring=constants.ring) + constants.ring.call,
        powersgd=powersgd_seconds(ranks, per_host=per_host, constants=constants, link=link),
        packed={name: packed_seconds(ranks, nbytes, codec=codec, per_host=per_host,
                                     host=host.shm, link=link, call=constants.ring.call)
                for name, codec in constants.codecs.items()})


class Run(NamedTuple):
    """Consecutive rank counts with the same fastest mechanism."""

    name: str
    first: int
    last: int


def winners(table: Dict[int, Mechanisms]) -> List[Run]:
    """The runs of rank counts (in the table's order) with the same fastest mechanism."""
    runs: List[Run] = []
    for ranks, row in table.items():
        best = row.best()
        if runs and runs[-1].name == best:
            runs[-1] = runs[-1]._replace(last=ranks)
        else:
            runs.append(Run(best, ranks, ranks))
    return runs


def first_above(shares: Dict[int, float], limit: float) -> Optional[int]:
    """The first rank count whose share exceeds ``limit``, or None."""
    return next((ranks for ranks, share in shares.items() if share > limit), None)


# -- project ---------------------------------------------------------------------------------
def _figure(value: float) -> str:
    """Three significant digits, without an exponent."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ms(seconds: float) -> str:
    return _figure(seconds * 1e3)


def _us(seconds: float) -> str:
    return _figure(seconds * 1e6)


def _mb(nbytes: float) -> str:
    return _figure(nbytes / 1e6)


def project(data: dict, per_host: int) -> str:
    """The markdown tables of the projections and of the checks."""
    constants = Constants.from_json(data)
    out = [f"# cost model: constants measured {data['date']}, commit {data['commit']}, "
           f"{data['machine']}, load average {data['load'][0]:.1f} to {data['load'][1]:.1f}; "
           f"{per_host} ranks per host, a {GRADIENT_BYTES / 1e6:.0f} MB float32 gradient", ""]
    busy = Constants.from_json(data, "busy_constants")
    out += _constants_table(constants, busy, fixed_costs(data["raw"]["local"]["2"]["tiny"],
                                                         2).whole)
    shaped = [name for name in LINKS if name in constants.links]
    tables = {}
    for name in shaped:
        link = constants.links[name]
        table = {n: mechanisms(n, per_host=per_host, constants=constants, link=link)
                 for n in RANKS}
        tables[name] = table
        codecs = list(constants.codecs)
        out += ["", f"## {name}: ms to sum the gradient (fastest in bold)", "",
                "| ranks | ring | hierarchical | PowerSGD | " + " | ".join(codecs) + " |",
                "|---|---|---|---|" + "---|" * len(codecs)]
        for n, row in table.items():
            times, best = row.every(), row.best()
            cells = [f"**{_ms(t)}**" if k == best else _ms(t) for k, t in times.items()]
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        runs = [f"{r.name} at {r.first}" + (f" to {r.last}" if r.last != r.first else "")
                for r in winners(table)]
        out += ["", "Fastest: " + "; ".join(runs) + " ranks."]
    out += _agreement_table(constants, tables, per_host)
    out += _memory_table(constants)
    out += _checks_table(data, busy)
    return "\n".join(out)


def _constants_table(alone: Constants, busy: Constants, whole: float) -> List[str]:
    """The constants; the compute timed in one process and in two at once (the checks')."""
    def both(label: str, show: Callable[[Constants], str]) -> str:
        mine, theirs = show(alone), show(busy)
        return f"| {label} | {mine} | {'same' if theirs == mine else theirs} |"
    rows = ["| constant | one process | two at once |", "|---|---|---|",
            both("ring: Python per step beyond the raw Sendrecv",
                 lambda c: f"{_us(c.ring.step)} µs"),
            f"| ring: (allreduce_ - agreement) / 2(N-1) - Sendrecv, the call's own cost spread "
            f"over its steps, 2 ranks | {_us(whole)} µs | same |",
            both("allreduce: Python per call beyond agreement and ring",
                 lambda c: f"{_us(c.ring.call)} µs"),
            both("agreement: Python per exchange beyond the raw allreduce of its record",
                 lambda c: f"{_us(c.agreement.fixed)} µs"),
            both("NumPy float32 sum", lambda c: f"{1e-9 / c.host.reduce_beta:.2f} GB/s"),
            both("shared memory: alpha, bandwidth",
                 lambda c: f"{_us(c.host.shm.alpha)} µs, {1e-9 / c.host.shm.beta:.2f} GB/s"),
            both("MPI_Gather / MPI_Bcast within a host, 2 ranks",
                 lambda c: f"{1e-9 / c.host.gather_beta:.2f} / {1e-9 / c.host.bcast_beta:.2f} "
                           "GB/s"),
            both("PowerSGD compute, 25 x 1000 x 1000 at rank 4",
                 lambda c: f"{_ms(c.powersgd_compute)} ms")]
    for name in alone.codecs:
        rows.append(both(f"{name}: encode, decode (payload 1/{1 / alone.codecs[name].wire:.0f} "
                         "of float32)",
                         lambda c: f"{1e-9 / c.codecs[name].encode:.2f}, "
                                   f"{1e-9 / c.codecs[name].decode:.2f} GB/s"))
    for name in alone.links:
        rows.append(both(f"link {name}: alpha, bandwidth",
                         lambda c: f"{_us(c.links[name].alpha)} µs, "
                                   f"{8e-9 / c.links[name].beta:.2f} Gbit/s"))
    return rows


def _agreement_table(c: Constants, tables: Dict[str, Dict[int, Mechanisms]],
                     per_host: int) -> List[str]:
    names = list(tables)
    out = ["", "## The agreement: one per step (µs), and its share of a step with the fastest "
           "mechanism", "",
           "| ranks | record B | " + " | ".join(f"{n}: agreement (share)" for n in names)
           + " |", "|---|---|" + "---|" * len(names)]
    shares: Dict[str, Dict[int, float]] = {n: {} for n in names}
    for ranks in sorted(set(RANKS) | {1000, 1500}):
        cells = [str(ranks), str(record_bytes(ranks))]
        for name in names:
            link = c.links[name]
            agree = agreement_seconds(ranks, per_host=per_host, agreement=c.agreement,
                                      host=c.host, link=link)
            row = tables[name].get(ranks) or mechanisms(ranks, per_host=per_host, constants=c,
                                                        link=link)
            share = agree / (agree + min(row.every().values()))
            shares[name][ranks] = share
            cells.append(f"{_us(agree)} ({share:.1%})")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for name in names:
        every = {n: shares[name][n] for n in shares[name]}
        above = first_above(every, 0.01)
        out.append(f"- {name}: the share passes 1% "
                   + (f"at {above} ranks" if above else "at no count up to 4,096")
                   + f"; at most {max(every.values()):.2%} (1,500 ranks: "
                   f"{every[1500]:.2%}, 4,096: {every[4096]:.2%}).")
    return out


def _memory_table(c: Constants) -> List[str]:
    codecs = list(c.codecs)
    out = ["", "## Packed codecs: MB each rank receives into per step (N x payload)", "",
           "| ranks | " + " | ".join(codecs) + " |", "|---|" + "---|" * len(codecs)]
    for ranks in RANKS:
        out.append(f"| {ranks} | " + " | ".join(
            _mb(packed_memory_bytes(ranks, GRADIENT_BYTES, codec=c.codecs[k])) for k in codecs)
            + " |")
    return out


class Check(NamedTuple):
    """A case that ``measure`` timed, and the model's seconds for it."""

    case: str
    measured: float
    predicted: float


def predictions(data: dict, constants: Constants) -> List[Check]:
    """Each measured case with the model's prediction for it from ``constants`` (those of two
    processes at once: the checks' ranks share the machine's cores), but for the cases the
    constants were taken from."""
    raw = data["raw"]
    host, ring = constants.host, constants.ring
    checks = []
    for ranks, local in raw["local"].items():
        n = int(ranks)
        timed = {**{size: times["ring"] for size, times in local["tiny"].items()},
                 **local["ring"]}
        for size, seconds in timed.items():
            if n == 2 and int(size) in TINY:
                continue  # the ring's step cost was taken from these cases
            checks.append(Check(f"our ring, {n} ranks, one host, {_size(int(size))}", seconds,
                                ring_seconds(n, int(size), link=host.shm, ring=ring,
                                             reduce_beta=host.reduce_beta)))
        if n != 2:  # the agreement's fixed cost was taken from 2 ranks
            checks.append(Check(f"agreement, {n} ranks, one host",
                                fixed_costs(local["tiny"], n).agreement,
                                agreement_seconds(n, per_host=n, agreement=constants.agreement,
                                                  host=host, link=host.shm)))
    for name, bed in raw["bed"].items():
        link = constants.links[name]
        agree = agreement_seconds(2, per_host=1, agreement=constants.agreement, host=host,
                                  link=link)
        checks += [
            Check(f"our ring, 2 hosts, {name}, 100 MB", bed["ring"],
                  ring_seconds(2, GRADIENT_BYTES, link=link, ring=ring,
                               reduce_beta=host.reduce_beta)),
            Check(f"agreement, 2 hosts, {name}", bed["agreement"], agree),
            # Called on their own, PowerSGD's two allreduces and the allgather make an
            # agreement each.
            Check(f"PowerSGD step, 2 hosts, {name}", bed["powersgd"],
                  powersgd_seconds(2, per_host=1, constants=constants, link=link) + 2 * agree),
            Check(f"2-bit step, 2 hosts, {name}", bed["2-bit"],
                  packed_seconds(2, GRADIENT_BYTES, codec=constants.codecs["2-bit"], per_host=1,
                                 host=host.shm, link=link, call=ring.call) + agree)]
        if "hierarchical" in bed:
            measured = bed["hierarchical"]
            checks += [
                Check(f"hierarchical, 2 hosts x 2 ranks, {name}, 100 MB",
                      measured["hierarchical"],
                      hierarchical_seconds(4, GRADIENT_BYTES, per_host=2, host=host, link=link,
                                           ring=ring)),
                Check(f"our ring, 2 hosts x 2 ranks, {name}, 100 MB", measured["ring"],
                      ring_seconds(4, GRADIENT_BYTES, link=link, ring=ring,
                                   reduce_beta=host.reduce_beta))]
    return checks


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MiB"
    return f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"


def _checks_table(data: dict, c: Constants) -> List[str]:
    out = ["", "## The model against what was measured (ms)", "",
           "| case | measured | predicted | predicted / measured |", "|---|---|---|---|"]
    for check in predictions(data, c):
        out.append(f"| {check.case} | {_ms(check.measured)} | {_ms(check.predicted)} | "
                   f"{check.predicted / check.measured:.2f} |")
    return out


# -- measure: the workers --------------------------------------------------------------------
def _best(variants: Dict[str, Callable[[], None]], rounds: int, iters: int) -> Dict[str, float]:
    """Each variant's best seconds per call over interleaved rounds (the slowest rank's)."""
    from allreduce import best_of
    return best_of(variants, rounds, iters)


def _ping_pong(comm, nbytes: int) -> float:
    """Best one-way seconds of ``nbytes`` between ranks 0 and 1 (half a round trip): small
    messages in many short rounds (a busy machine's pauses then miss some rounds), large
    ones in 3 rounds of 2 round trips or more."""
    import numpy as np
    buf = np.zeros(nbytes, np.uint8)
    rounds, iters = (30, 20) if nbytes <= 65536 else (3, max(2, (32 << 20) // nbytes))
    peer = 1 - comm.rank

    def exchange() -> None:
        if comm.rank == 0:
            comm.Send(buf, peer, 5)
            comm.Recv(buf, peer, 5)
        else:
            comm.Recv(buf, peer, 5)
            comm.Send(buf, peer, 5)
    return _best({"ping-pong": exchange}, rounds, iters)["ping-pong"] / 2


def _agreement_alone(comm) -> Callable[[], None]:
    """The agreement an allreduce makes, alone (a call agreed on from its signature)."""
    from hvd_trainer.coordination import agreement

    def run() -> None:
        with agreement.collective(comm, "allreduce", "cost") as call:
            call.agree(dict, signature=("cost",))
    return run


def _raw_record_allreduce(nbytes: int) -> Callable[[], None]:
    """A raw persistent bitwise-or MPI_Allreduce of ``nbytes``, started and polled by Test as
    the agreement starts and polls one (MPI_Wait's own waiting differs: under load it gave
    more than the whole agreement)."""
    import numpy as np
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    send = np.zeros(nbytes // 8, np.int64)
    recv = np.zeros_like(send)
    request = world.Allreduce_init(send, recv, MPI.BOR)
    test = request.Test

    def run() -> None:
        request.Start()
        while not test():
            pass
    return run


def local_worker() -> None:
    """One rank of a job on this host (HVD_ALLREDUCE_ALGO=ring)."""
    import numpy as np
    from mpi4py import MPI

    import hvd_trainer as hvd
    from common import report
    from hvd_trainer.runtime import runtime

    hvd.init()
    world, n = MPI.COMM_WORLD, hvd.size()
    comm = runtime.communicator(hvd.global_process_set)
    right, left = (world.rank + 1) % n, (world.rank - 1) % n
    tiny = {}
    for size in TINY:
        buf = np.ones(size // 4, np.float32)
        send = np.zeros(size // n, np.uint8)
        recv = np.empty_like(send)
        tiny[size] = _best({
            "op": lambda: hvd.allreduce_(buf, op=hvd.Sum, name="cost"),
            "agreement": _agreement_alone(comm),
            "ring": lambda: comm.ring_allreduce(buf, "sum"),
            "sendrecv": lambda: world.Sendrecv([send, MPI.BYTE], right, 0,
                                               [recv, MPI.BYTE], left, 0)}, 40, 25)
    record = record_bytes(n)
    allreduce = _best({"record": _raw_record_allreduce(record)}, 40, 25)
    ring = {}
    for size in CHECKED:
        buf = np.ones(size // 4, np.float32)
        ring[size] = _best({"ring": lambda: comm.ring_allreduce(buf, "sum")}, 3,
                           max(3, (64 << 20) // size // 4))["ring"]
    result = {"ranks": n, "tiny": tiny, "record": record, "allreduce": allreduce, "ring": ring}
    if n == 2:
        result["ping_pong"] = {size: _ping_pong(world, size) for size in PING_PONG}
        big = np.ones(16 << 20, np.uint8)
        gathered = np.empty(2 * big.size, np.uint8)
        result["host_steps"] = _best({"gather": lambda: world.Gather(big, gathered, 0),
                                      "bcast": lambda: world.Bcast(big, 0)}, 3, 5)
        result["host_bytes"] = big.size
    if world.rank == 0:
        report(result)


def host_worker() -> None:
    """One process: NumPy's sum, the codecs, PowerSGD's compute."""
    import numpy as np

    import hvd_trainer as hvd
    from common import report
    from compression import codec_speed
    from hvd_trainer import compression
    from hvd_trainer.collectives.powersgd import PowerSGD, PowerSGDSum

    hvd.init()
    rng = np.random.default_rng(0)
    # 64 MiB arrays, past the caches, as the ring's chunks of a 100 MB gradient on few ranks.
    a, b = np.ones(16 << 20, np.float32), np.ones(16 << 20, np.float32)
    reduce = min(_timed(lambda: np.add(a, b, out=a)) for _ in range(7)) / a.nbytes
    del a, b
    grad = (rng.standard_normal(GRADIENT_BYTES // 4) * 0.5).astype(np.float32)
    codecs = {}
    for name, params in CODECS.items():
        speed = codec_speed(params, grad)
        codec = compression.from_params(params)
        codecs[name] = {"encode": speed["encode"] / grad.nbytes,
                        "decode": speed["decode"] / grad.nbytes,
                        "wire": codec.wire_bytes(grad.size) / grad.nbytes}
    del grad
    summer = PowerSGDSum(PowerSGD(rank=POWERSGD_RANK, start_iter=0))
    matrices = [rng.standard_normal((POWERSGD_SIDE, POWERSGD_SIDE)).astype(np.float32)
                for _ in range(POWERSGD_MATRICES)]
    powersgd = float("inf")
    for repetition in range(4):
        named = [(f"m{i}", m.copy()) for i, m in enumerate(matrices)]
        took = _timed(lambda: summer.sum_(named, "cost"))
        powersgd = min(powersgd, took) if repetition else powersgd  # the first warms up
    report({"reduce_beta": reduce, "codecs": codecs, "powersgd": powersgd})


def _timed(fn: Callable[[], object]) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def link_worker() -> None:
    """One rank of a 2-rank job across the test bed's two hosts."""
    import numpy as np
    from mpi4py import MPI

    import hvd_trainer as hvd
    from common import report
    from hvd_trainer.collectives.feedback import ErrorFeedbackSum
    from hvd_trainer.collectives.powersgd import PowerSGD, PowerSGDSum
    from hvd_trainer import compression
    from hvd_trainer.runtime import runtime

    hvd.init()
    world = MPI.COMM_WORLD
    comm = runtime.communicator(hvd.global_process_set)
    result = {"ping_pong": {size: _ping_pong(world, size) for size in PING_PONG}}
    result["agreement"] = _best({"agreement": _agreement_alone(comm)}, 5, 100)["agreement"]
    grad = np.ones(GRADIENT_BYTES // 4, np.float32)
    result["ring"] = _best({"ring": lambda: comm.ring_allreduce(grad, "sum")}, 3, 1)["ring"]
    rng = np.random.default_rng(world.rank)
    matrices = [rng.standard_normal((POWERSGD_SIDE, POWERSGD_SIDE)).astype(np.float32)
                for _ in range(POWERSGD_MATRICES)]
    summer = PowerSGDSum(PowerSGD(rank=POWERSGD_RANK, start_iter=0))
    named = [(f"m{i}", m.copy()) for i, m in enumerate(matrices)]
    result["powersgd"] = _best({"powersgd": lambda: summer.sum_(named, "cost")}, 4, 1)["powersgd"]
    del matrices, named
    feedback = ErrorFeedbackSum(compression.from_params(CODECS["2-bit"]))
    gradient = [("g", (rng.standard_normal(GRADIENT_BYTES // 4) * 0.5).astype(np.float32))]
    result["2-bit"] = _best({"2-bit": lambda: feedback.sum_(gradient, "cost")}, 4, 1)["2-bit"]
    if world.rank == 0:
        report(result)


# -- measure: the parent ---------------------------------------------------------------------
def _commit() -> str:
    from common import commit
    dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return commit() + (" (with uncommitted changes)" if dirty else "")


def _measure_bed() -> Dict[str, dict]:
    """The link constants and the checks across the test bed's two hosts, per link."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "multihost"))
    from hierarchical import launch as hierarchical_launch
    from slow_link import bed_result, shape, two_hosts

    measured = {}
    with two_hosts("cost_model (or run with --no-bed)") as bed:
        for name in LINKS:
            shape(bed, None if name == "bare veth" else name, 0)
            measured[name] = bed_result(bed, ["-np", "2", "-H", "h1:1,h2:1"], __file__,
                                        ["link"], {}, f"link worker ({name})")
            if name != "bare veth":
                times = hierarchical_launch(bed, str(GRADIENT_BYTES / (1 << 20)), 3)
                measured[name]["hierarchical"] = {mode: min(t) for mode, t in
                                                  next(iter(times.values())).items()}
            print(f"# {name}: done", file=sys.stderr, flush=True)
    return measured


class Fixed(NamedTuple):
    """The fixed costs of a small call, from one job's tiny sizes: each is the smallest
    estimate over the sizes (none depends on the size, and a busy machine only adds)."""

    step: float       # ring / 2(N-1) - Sendrecv of the chunk
    call: float       # allreduce_ - agreement - ring
    agreement: float  # the agreement alone
    whole: float      # (allreduce_ - agreement) / 2(N-1) - Sendrecv: the call's cost in steps


def fixed_costs(tiny: Dict[str, Dict[str, float]], ranks: int) -> Fixed:
    """:class:`Fixed` from a local job's tiny cases (per size: op, agreement, ring, sendrecv)."""
    steps = 2 * (ranks - 1)
    return Fixed(step=min(t["ring"] / steps - t["sendrecv"] for t in tiny.values()),
                 call=min(t["op"] - t["agreement"] - t["ring"] for t in tiny.values()),
                 agreement=min(t["agreement"] for t in tiny.values()),
                 whole=min((t["op"] - t["agreement"]) / steps - t["sendrecv"]
                           for t in tiny.values()))


def slower(first: dict, second: dict) -> dict:
    """Two processes' measurements (nested dicts of seconds), the larger of each."""
    return {key: slower(value, second[key]) if isinstance(value, dict)
            else max(value, second[key]) for key, value in first.items()}


def constants_from(local: Dict[int, dict], one: dict, bed: Dict[str, dict]) -> dict:
    """The model's constants from the raw measurements (2 ranks: one core each)."""
    two = local[2]
    fixed = fixed_costs(two["tiny"], 2)
    ping = two["ping_pong"]
    shm = fit_link([int(s) for s in ping], list(ping.values()))
    nbytes = two["host_bytes"]
    host_steps = two["host_steps"]
    constants = {
        "host": {"shm": dataclasses.asdict(shm),
                 "gather_beta": (host_steps["gather"] - shm.alpha) / nbytes,
                 "bcast_beta": (host_steps["bcast"] - shm.alpha) / nbytes,
                 "reduce_beta": one["reduce_beta"]},
        "ring": {"step": fixed.step, "call": fixed.call},
        "agreement": {"fixed": fixed.agreement - two["allreduce"]["record"]},
        "codecs": one["codecs"], "powersgd_compute": one["powersgd"],
        "links": {}}
    for name, measured in bed.items():
        pings = measured["ping_pong"]
        constants["links"][name] = dataclasses.asdict(
            fit_link([int(s) for s in pings], list(pings.values())))
    return constants


def measure(path: str, *, with_bed: bool) -> None:
    """Measure everything (the bed only ``with_bed``) and write it to ``path`` (new, 0600)."""
    from common import cpu_model, launch
    started = os.getloadavg()[0]
    env = {"HVD_ALLREDUCE_ALGO": "ring"}
    local = {}
    for ranks in (2, 3):
        local[ranks] = launch(__file__, ranks, ["--worker", "local"], env=env)
        print(f"# {ranks} ranks on this host: done", file=sys.stderr, flush=True)
    one = launch(__file__, 1, ["--worker", "host"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pair = list(pool.map(lambda _: launch(__file__, 1, ["--worker", "host"]), range(2)))
    print("# one process, and two at once: done", file=sys.stderr, flush=True)
    bed = _measure_bed() if with_bed else {}
    from mpi4py import MPI
    data = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "commit": _commit(),
            "machine": f"{platform.node()}, {os.cpu_count()} cores ({cpu_model()}), "
                       + " ".join(MPI.Get_library_version().splitlines()[0].split()),
            "load": [started, os.getloadavg()[0]],
            "constants": constants_from(local, one, bed),
            "busy_constants": constants_from(local, slower(*pair), bed),
            "raw": {"local": local, "one_process": one, "two_processes": pair, "bed": bed}}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    print(f"# wrote {path}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["local", "host", "link"], help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command")
    measuring = sub.add_parser("measure", help="measure the constants (the bed needs root)")
    measuring.add_argument("path", help="the JSON file to write (must not exist)")
    measuring.add_argument("--no-bed", action="store_true", help="skip the 2-host test bed")
    projecting = sub.add_parser("project", help="print the projections from the constants")
    projecting.add_argument("path", help="the JSON file measure wrote")
    projecting.add_argument("--ranks-per-host", type=int, default=8,
                            help="ranks on each host, a power of two (default 8)")
    nccl = sub.add_parser("nccl", help="NCCL's expected busbw on 8 GPUs per host "
                                       "(nccl_model.py; no constants needed)")
    nccl.add_argument("--host-us", type=float, nargs="+", default=[60.0, 15.0],
                      help="our host time per call, in µs (default: 60, as measured on an "
                           "H200, and 15, the target)")
    args, rest = parser.parse_known_args()
    if args.worker:
        {"local": local_worker, "host": host_worker, "link": link_worker}[args.worker]()
        return
    if args.command == "measure":
        measure(args.path, with_bed=not args.no_bed)
    elif args.command == "project":
        per_host = args.ranks_per_host
        if per_host < 1 or per_host & (per_host - 1):
            parser.error(f"--ranks-per-host={per_host} must be a power of two, e.g. 8")
        with open(args.path) as f:
            print(project(json.load(f), per_host))
    elif args.command == "nccl":
        sys.path.insert(0, HERE)
        import nccl_model
        print("\n\n".join(nccl_model.table(f, args.host_us) for f in nccl_model.FABRICS))
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
