"""What a bucketed NCCL allreduce should give on hosts of 8 GPUs, from NCCL's own figures: no
GPU is needed, and none of it was measured here (multi-rank NCCL has never run here).

Run:  python benchmarks/cost_model.py nccl [--host-us 60 15]

The model, with its sources (docs/scaling.md#nccl-on-8-gpus-per-host cites them in full):

* bus bandwidth, as nccl-tests defines it (doc/PERFORMANCE.md): for an allreduce of S bytes
  on n ranks in t seconds, algbw = S/t and busbw = algbw * 2(n-1)/n, the bandwidth each
  rank's link must carry, which does not depend on n;
* the busbw NCCL reaches on large sizes, from its maintainers: on 8 H100s over NVLink about
  370 GB/s for the ring and about 480 GB/s with NVLink SHARP (NVLS, one host only; NVIDIA/
  nccl-tests#212), 46-48 GB/s per NDR 400 Gb/s NIC (NVIDIA/nccl-tests#290); on DGX A100
  192 GB/s across hosts with 8 HDR 200 Gb/s NICs (NVIDIA/nccl#812), and at most 235 GB/s
  within one (the cap NCCL 2.7's tuner set for A100, src/graph/tuning.cc). Across hosts the
  ring's busbw is the smaller of the NVLink figure and the host's NICs together;
* the latency, from NCCL's own tuner (src/graph/tuning.cc, v2.30.7, its default constants,
  Simple protocol): the ring 8.4 us, plus 3.4 us for each of the 2(n-1) steps within a host
  and 14 us for each of the 2(H-1) steps that cross hosts; the tree 8.4 us plus
  2((L-1) * 4 us + log2(H) * 14 us) for L GPUs on each of H hosts; NVLS 25 us. The tree is
  taken at the ring's busbw: with 8 NICs a host, NCCL's maintainers say, the tree "will
  struggle to get better performance than ring" (NVIDIA/nccl-tests#196). NCCL takes the
  fastest;
* our allreduce: each bucket's call also spends ``host`` seconds of Python on the host
  (docs/performance.md#gpu: 50-80 us a call on an H200, NCCL's own 5-8 us, 2026-12-04).
  The host queues work ahead of the GPU, so a run of buckets takes the longer of the two
  per bucket: busbw = S * 2(n-1)/n / max(NCCL's time, host).
"""
from typing import List, NamedTuple, Sequence

MiB = 1 << 20
# NCCL's tuner, v2.30.7 (src/graph/tuning.cc): Ring/Simple latencies in microseconds.
RING_BASE_US, RING_NVLINK_STEP_US, RING_NET_STEP_US = 8.4, 3.4, 14.0
TREE_BASE_US, TREE_NVLINK_STEP_US, TREE_NET_STEP_US = 8.4, 4.0, 14.0
NVLS_US = 25.0


class Fabric(NamedTuple):
    """A host of GPUs: the ring's busbw over NVLink (GB/s), NVLS's (0: none), and its NICs."""

    name: str
    nvlink_busbw: float
    nvls_busbw: float
    nics: int
    nic_busbw: float


FABRICS = (Fabric("8x H100 (NVLink 4, NVLS), 8 NDR 400 Gb/s NICs", 370.0, 480.0, 8, 47.0),
           Fabric("8x A100 (NVLink 3), 8 HDR 200 Gb/s NICs", 235.0, 0.0, 8, 24.0))


def hosts(ranks: int, per_host: int) -> int:
    return max(1, ranks // per_host)


def ring_latency(ranks: int, per_host: int) -> float:
    """NCCL's latency (seconds) of a Ring/Simple allreduce on ``ranks`` ranks."""
    crossing = 2 * (hosts(ranks, per_host) - 1)
    steps = 2 * (ranks - 1)
    return (RING_BASE_US + (steps - crossing) * RING_NVLINK_STEP_US
            + crossing * RING_NET_STEP_US) * 1e-6


def tree_latency(ranks: int, per_host: int) -> float:
    """NCCL's latency (seconds) of a Tree/Simple allreduce: up and down a chain within each
    host and a tree of the hosts."""
    levels = max(hosts(ranks, per_host) - 1, 0).bit_length()  # log2 of the hosts, rounded up
    return (TREE_BASE_US + 2 * ((min(per_host, ranks) - 1) * TREE_NVLINK_STEP_US
                                + levels * TREE_NET_STEP_US)) * 1e-6


def ring_busbw(ranks: int, per_host: int, fabric: Fabric) -> float:
    """The ring's busbw (bytes per second): NVLink's within a host, across hosts no more than
    the host's NICs carry together."""
    if hosts(ranks, per_host) == 1:
        return fabric.nvlink_busbw * 1e9
    return min(fabric.nvlink_busbw, fabric.nics * fabric.nic_busbw) * 1e9


def bus_bytes(nbytes: float, ranks: int) -> float:
    """The bytes busbw counts for an allreduce of ``nbytes``: nbytes * 2(n-1)/n."""
    return nbytes * 2 * (ranks - 1) / ranks


def nccl_seconds(nbytes: float, ranks: int, per_host: int, fabric: Fabric) -> float:
    """NCCL's time for one allreduce of ``nbytes``: the fastest of the ring, the tree and,
    on one host with it, NVLS."""
    moved = bus_bytes(nbytes, ranks) / ring_busbw(ranks, per_host, fabric)
    best = min(ring_latency(ranks, per_host), tree_latency(ranks, per_host)) + moved
    if hosts(ranks, per_host) > 1 or not fabric.nvls_busbw:
        return best
    return min(best, NVLS_US * 1e-6 + bus_bytes(nbytes, ranks) / (fabric.nvls_busbw * 1e9))


def bucketed_busbw(bucket: float, ranks: int, per_host: int, fabric: Fabric,
                   host: float = 0.0) -> float:
    """busbw (bytes per second) of a run of allreduces of ``bucket`` bytes each, when each
    call also spends ``host`` seconds on the host."""
    return bus_bytes(bucket, ranks) / max(nccl_seconds(bucket, ranks, per_host, fabric), host)


def table(fabric: Fabric, host_us: Sequence[float], per_host: int = 8,
          ranks: Sequence[int] = (8, 16, 64, 512),
          buckets: Sequence[int] = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)) -> str:
    """Markdown: busbw (GB/s) of NCCL alone and of ours at each host time, per bucket size
    and rank count."""
    head = ["ranks", "bucket", "NCCL µs", "NCCL GB/s"] + [f"ours, {h:g} µs host"
                                                         for h in host_us]
    rows: List[str] = [f"{fabric.name}, {per_host} GPUs per host (busbw GB/s)", "",
                       "| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for n in ranks:
        for b in buckets:
            t = nccl_seconds(b, n, per_host, fabric)
            ours = [bucketed_busbw(b, n, per_host, fabric, h * 1e-6) / 1e9 for h in host_us]
            rows.append(f"| {n} | {b // MiB} MiB | {t * 1e6:.0f} | "
                        f"{bus_bytes(b, n) / t / 1e9:.0f} | "
                        + " | ".join(f"{o:.0f}" for o in ours) + " |")
    return "\n".join(rows)
