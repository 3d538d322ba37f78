"""PowerSGD across two hosts: our step against DDP's ``powerSGD_hook``, uncompressed and 2-bit,
as the link slows, with the bytes each host puts on the link.

Run (as root):  python benchmarks/powersgd_link.py [--rounds 1] [--rates 1gbit,10gbit]
                [--rank 4] [--start-iter 2]
It builds the 2-host test bed of tests/multihost/testbed.py and takes it down at the end. Per
link (the bare veth link, then tc tbf at each rate on both hosts' lan0, shaped as
benchmarks/slow_link.py does) each variant is one launch of 2 ranks, one on h1 and one on h2:

* torch, the 8 x Linear(2048) MLP of benchmarks/powersgd_step.py (batch 64 per rank, SGD with
  momentum): ours (``DistributedOptimizer``, hvdrun -H h1:1,h2:1 --network-interface lan0)
  uncompressed and with ``Compression.powersgd(rank, start_iter)``; DDP on gloo uncompressed
  and with ``powerSGD_hook`` (same rank and start iteration, one bucket), started by torchrun
  on each host (``--nnodes 2 --node-rank i``, h1's lan0 address as the master) through the
  bed, with GLOO_SOCKET_IFNAME=lan0;
* Gluon, the 8 x Dense(2048) MLP of benchmarks/slow_link.py (``DistributedTrainer``, hvdrun
  as above): uncompressed, ``{'type': 'powersgd', 'rank': r, 'start_iter': s}`` and 2-bit
  (threshold 0.5).

The warm-up steps pass the start iteration, so the timed steps are compressed. Each rank
reads its host's lan0 counters (/sys/class/net/lan0/statistics/{tx,rx}_bytes, inside the
host's network namespace) after the warm-up and after the timed steps; the table gives the
bytes the busier host sent per timed step (its barriers and timing allreduces included, a
few hundred bytes). One thread per rank; launches go through the variants in turn, each
variant keeps its best launch (a launch's time is its best repetition, the slowest rank's).
Ratios are against DDP uncompressed and against our uncompressed step (Gluon's for the Gluon
rows) on the same link. The last lines check issue 38's targets.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "multihost"))
import common  # noqa: E402
from powersgd_step import NAME, setup, warmup_steps  # noqa: E402
from slow_link import (BATCH, LAYERS, REPETITIONS, STEPS, WIDTH, bed_result, shape,  # noqa: E402
                       two_hosts)
from torch_ddp import MODELS, REPETITIONS as TORCH_REPETITIONS, seconds_per_step  # noqa: E402

TORCH = ("hvd", "hvd-powersgd", "ddp", "ddp-powersgd")
GLUON = ("gluon", "gluon-powersgd", "gluon-2bit")
LABELS = {"hvd": "ours uncompressed", "hvd-powersgd": "ours PowerSGD",
          "ddp": "DDP uncompressed", "ddp-powersgd": "DDP powerSGD_hook",
          "gluon": "uncompressed", "gluon-powersgd": "PowerSGD", "gluon-2bit": "2-bit 0.5"}
DDP_PORT = 29400  # h1's port for torchrun's rendezvous (in the bed's own network namespace)


class LinkCounters(NamedTuple):
    """Bytes this host's lan0 has sent and received so far."""

    sent: int
    received: int


def link_counters() -> LinkCounters:
    """This host's lan0 counters, from the kernel (the namespace this rank runs in)."""
    def read(name: str) -> int:
        with open(f"/sys/class/net/lan0/statistics/{name}") as f:
            return int(f.read())
    return LinkCounters(read("tx_bytes"), read("rx_bytes"))


def torch_worker(variant: str, rank: int, start_iter: int) -> None:
    """One rank of a torch launch: seconds per step and link bytes per step."""
    inputs, _, _, steps = MODELS[NAME]
    net, optimizer, timing = setup(variant, rank, start_iter)
    before: List[LinkCounters] = []
    best = seconds_per_step(net, optimizer, inputs, steps, warmup_steps(start_iter), timing,
                            warm=lambda: before.append(link_counters()))
    after = link_counters()
    timed = steps * TORCH_REPETITIONS
    sent = timing.slowest((after.sent - before[0].sent) / timed)
    received = timing.slowest((after.received - before[0].received) / timed)
    if timing.rank == 0:
        common.report({"seconds": best, "sent": sent, "received": received})


def gluon_worker(variant: str, rank: int, start_iter: int) -> None:
    """One rank of a Gluon launch: seconds per step and link bytes per step."""
    import mxnet as mx
    import numpy as np

    import hvd_trainer
    params = {"gluon": None, "gluon-2bit": {"type": "2bit", "threshold": 0.5},
              "gluon-powersgd": {"type": "powersgd", "rank": rank, "start_iter": start_iter}}
    net = common.dense_mlp(LAYERS, WIDTH)
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd",
                                             {"learning_rate": 0.01, "momentum": 0.9},
                                             compression_params=params[variant])
    x = mx.nd.random.uniform(shape=(BATCH, WIDTH))
    y = mx.nd.array(np.random.RandomState(0).randint(0, 10, BATCH))
    step = common.training_step(net, trainer, x, y)
    for _ in range(warmup_steps(start_iter)):
        step()
    mx.nd.waitall()
    before = link_counters()
    best = common.seconds_per_step(step, STEPS, REPETITIONS, 0, distributed=True)
    after = link_counters()
    timed = STEPS * REPETITIONS
    sent = common.slowest_rank((after.sent - before.sent) / timed, distributed=True)
    received = common.slowest_rank((after.received - before.received) / timed, distributed=True)
    if hvd_trainer.rank() == 0:
        common.report({"seconds": best, "sent": sent, "received": received})


def ddp_launch(bed, variant: str, options: List[str], port: int) -> dict:
    """A DDP launch: torchrun on h1 (node 0, the master at its lan0 address, ``port``) and on
    h2 (node 1), one process each; the RESULT node 0's rank printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lan0")
    runs = []
    for node, host in enumerate(("h1", "h2")):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "1", "--node-rank", str(node),
                   "--master-addr", bed.address("h1"), "--master-port", str(port),
                   os.path.abspath(__file__), "--worker", variant, *options]
        log = tempfile.TemporaryFile("w+")  # a file, not a pipe: nothing blocks on a full pipe
        runs.append((bed.popen(host, command, cwd=bed.shared, env=env, stdout=log,
                               stderr=subprocess.STDOUT, text=True), log))
    outputs = []
    for process, log in runs:
        process.wait(timeout=1800)  # on a timeout, bed.down() ends what the bed still runs
        log.seek(0)
        outputs.append(log.read())
        log.close()
    found = [line for line in outputs[0].splitlines() if line.startswith("RESULT ")]
    if any(process.returncode for process, _ in runs) or not found:
        raise RuntimeError(f"DDP launch of {variant} exited "
                           f"{[process.returncode for process, _ in runs]}\n"
                           + "\n".join(outputs))
    return json.loads(found[0][len("RESULT "):])


class Row(NamedTuple):
    """A variant's best launch on one link."""

    seconds: float
    sent: float
    received: float


def table(best: Dict[tuple, Row], links: List[str]) -> List[str]:
    """The markdown table: ms/step, the two ratios and the bytes per step."""
    lines = ["| link | framework | variant | ms/step | / DDP uncompressed | / ours uncompressed "
             "| MB sent per step (busier host) |", "|---|---|---|---|---|---|---|"]
    for link in links:
        for framework, variants, ours in (("torch", TORCH, "hvd"), ("Gluon", GLUON, "gluon")):
            for variant in variants:
                row = best[link, variant]
                ddp = (f"{row.seconds / best[link, 'ddp'].seconds:.2f}" if framework == "torch"
                       else "-")
                lines.append(f"| {link} | {framework} | {LABELS[variant]} "
                             f"| {row.seconds * 1e3:.0f} | {ddp} "
                             f"| {row.seconds / best[link, ours].seconds:.2f} "
                             f"| {row.sent / 1e6:.2f} |")
    return lines


def verdicts(best: Dict[tuple, Row], rates: List[str]) -> List[str]:
    """Issue 38's targets, per shaped link."""
    lines = []
    for rate in rates:
        ours, ddp = best[rate, "hvd-powersgd"].seconds, best[rate, "ddp-powersgd"].seconds
        lines.append(f"{rate}: ours PowerSGD / DDP powerSGD_hook = {ours / ddp:.2f} "
                     f"({'met' if ours <= ddp else 'NOT met'}: target <= 1)")
    slow = rates[0]
    ratio = best[slow, "hvd-powersgd"].seconds / best[slow, "hvd"].seconds
    lines.append(f"{slow}: ours PowerSGD / ours uncompressed = {ratio:.2f} "
                 f"({'met' if ratio <= 0.5 else 'NOT met'}: target <= 0.5)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="launches per variant and link")
    parser.add_argument("--rates", default="1gbit,10gbit", help="tbf rates, slow first")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's approximation rank")
    parser.add_argument("--start-iter", type=int, default=2,
                        help="exact steps before compression (DDP needs more than 1)")
    parser.add_argument("--worker", choices=TORCH + GLUON, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker = torch_worker if args.worker in TORCH else gluon_worker
        worker(args.worker, args.rank, args.start_iter)
        return

    rates = args.rates.split(",")
    links = ["bare veth"] + rates
    options = ["--rank", str(args.rank), "--start-iter", str(args.start_iter)]
    order = [v for pair in zip(TORCH, GLUON + (None,)) for v in pair if v is not None]
    best: Dict[tuple, Row] = {}
    port = DDP_PORT
    with two_hosts("powersgd_link") as bed:
        for _ in range(args.rounds):
            for link in links:
                shape(bed, None if link == "bare veth" else link, 0.0)
                for variant in order:
                    if variant.startswith("ddp"):
                        port += 1  # a fresh port: the last launch's may still be closing
                        got = ddp_launch(bed, variant, options, port)
                    else:
                        got = bed_result(bed, ["-np", "2", "-H", "h1:1,h2:1"], __file__,
                                         [variant, *options], {}, f"{variant} launch")
                    row = Row(got["seconds"], got["sent"], got["received"])
                    if (link, variant) not in best or row.seconds < best[link, variant].seconds:
                        best[link, variant] = row
                    print(f"# {link} {variant}: {row.seconds * 1e3:.0f} ms, sent "
                          f"{row.sent / 1e6:.2f} MB, received {row.received / 1e6:.2f} MB "
                          f"per step", file=sys.stderr, flush=True)

    from mpi4py import MPI
    print(common.header(
        f"PowerSGD rank {args.rank} from step {args.start_iter} across 2 test-bed hosts",
        f"{MPI.Get_library_version().splitlines()[0].strip()}, commit {common.commit()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end, batch {BATCH} per rank, "
        f"1 thread per rank, best of {args.rounds} launch(es) per variant"))
    print("\n".join(table(best, links)))
    print("\n".join(verdicts(best, rates)))


if __name__ == "__main__":
    main()
