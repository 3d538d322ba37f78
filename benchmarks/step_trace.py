"""Where the torch step's time goes on the 2-host bed: per-phase timestamps of single steps.

Run:  python benchmarks/step_trace.py [--bed 1gbit] [--codecs none fp16 ...] [--against REV]
      (needs root: the 2-host test bed of tests/multihost/testbed.py; wrap it in
      ``flock /tmp/hvd-bed.lock``)

A probe, not a timing of record: each rank of compressed_step.py's step (8 x Linear(2048),
batch 64, 2 ranks on h1 and h2, one thread each) wraps a few of hvd_trainer's internal
functions with clocks (each MPI send/receive phase, allgather and small allreduce, the
meeting before each bucket, the step's agreement, each bucket's hook, 16-bit narrowing and
widening, each bucket's completion) and times 4 steps after 3. Both ranks run on this
machine's clock (perf_counter is the same monotonic clock in every namespace). Per step and
rank it prints: forward, backward and synchronize() ends, the update; the first hook's start
and the last one's end; how long the link was busy in between (the union of the transfers);
the time spent meeting, in buckets under 1 MB, in the agreement, and narrowing and widening.
With ``--against REV`` REV's tree (``git archive``) is traced in the same bed after this one.
The wrappers reach into private functions, so the probe follows this tree's code: it checks
that each exists and fails by name when one moved.
"""
import argparse
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

EVENTS: List[Dict[str, Any]] = []
WIRE = ("sendrecv", "allgatherv", "comm.allreduce")


def record(what: str, start: float, end: float, **extra: Any) -> None:
    """One event of the step being traced."""
    EVENTS.append(dict(what=what, t0=start, t1=end, thread=threading.current_thread().name,
                       **extra))


def clocked(owner: Any, attr: str, label: str,
            info: Optional[Callable[..., Dict[str, Any]]] = None) -> None:
    """Replace ``owner.attr`` by a function that records each call's span as ``label``."""
    if not hasattr(owner, attr):
        raise SystemExit(f"step_trace: {owner!r} has no {attr} any more; update the probe")
    original = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        tic = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record(label, tic, time.perf_counter(), **(info(*args) if info else {}))
    setattr(owner, attr, wrapped)


def instrument() -> None:
    """Clock the phases listed in the module docstring."""
    from hvd_trainer.backends import mpi
    from hvd_trainer.coordination import agreement
    from hvd_trainer.torch import compression
    from hvd_trainer.training import program, step

    nbytes = (lambda self, buf, *rest: {"n": int(buf.nbytes)})
    clocked(mpi.MPICommunicator, "_sendrecv", "sendrecv", nbytes)
    clocked(mpi.MPICommunicator, "allgatherv", "allgatherv", nbytes)
    clocked(mpi.MPICommunicator, "allreduce", "comm.allreduce", nbytes)
    clocked(agreement, "meet", "meet")
    clocked(agreement, "agree", "agree")
    clocked(program, "_call", "hook", lambda reducer, bucket: {"n": int(bucket.buffer.nbytes)})
    clocked(step.Step, "reduced", "reduced", lambda self, number, array: {"bucket": number})
    for name in ("narrow", "widen"):
        clocked(compression.KERNELS, name, name)


def summary(step: Dict[str, Any]) -> Dict[str, float]:
    """The figures of one traced step (ms from its start)."""
    t0, events = step["t0"], step["events"]
    spans = sorted((e["t0"], e["t1"]) for e in events if e["what"] in WIRE)
    busy, current = 0.0, None
    for a, b in spans:  # the union of the transfers: the link's busy time
        if current and a <= current[1]:
            current[1] = max(current[1], b)
            continue
        if current:
            busy += current[1] - current[0]
        current = [a, b]
    busy += current[1] - current[0] if current else 0.0

    def total(*whats: str, small: bool = False) -> float:
        return sum(e["t1"] - e["t0"] for e in events if e["what"] in whats
                   and (not small or e.get("n", 0) < 1e6)) * 1e3
    hooks = [e for e in events if e["what"] == "hook"]
    return {"forward": (step["forward"] - t0) * 1e3, "backward": (step["backward"] - t0) * 1e3,
            "synchronized": (step["synchronized"] - t0) * 1e3,
            "update": (step["end"] - step["synchronized"]) * 1e3,
            "step": (step["end"] - t0) * 1e3, "cpu": step["cpu"] * 1e3,
            "first hook": (min(e["t0"] for e in hooks) - t0) * 1e3,
            "last hook end": (max(e["t1"] for e in hooks) - t0) * 1e3,
            "link busy": busy * 1e3, "meetings": total("meet"), "agreement": total("agree"),
            "small buckets": total("hook", small=True), "buckets": float(len(hooks)),
            "narrow + widen": total("narrow", "widen")}


def worker(codecs: List[str]) -> None:
    """One rank: 7 steps per codec, the last 4 traced; rank 0 writes every rank's summaries."""
    import torch

    import compressed_step
    import hvd_trainer
    import hvd_trainer.torch as hvd

    instrument()
    torch.set_num_threads(1)
    hvd.init()
    mine: Dict[str, List[Dict[str, float]]] = {}
    for name in codecs:
        torch.manual_seed(0)
        layers = []
        for _ in range(compressed_step.LAYERS):
            layers += [torch.nn.Linear(compressed_step.WIDTH, compressed_step.WIDTH),
                       torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(compressed_step.WIDTH, 10))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
            named_parameters=[(f"{name}.{n}", p) for n, p in net.named_parameters()],
            compression=compressed_step.compressor(name))
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        x = torch.rand(compressed_step.BATCH, compressed_step.WIDTH)
        y = torch.randint(0, 10, (compressed_step.BATCH,))
        mine[name] = []
        for number in range(7):
            hvd.barrier()
            EVENTS.clear()
            cpu, t0 = time.process_time(), time.perf_counter()
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            optimizer.synchronize()
            synchronized = time.perf_counter()
            with optimizer.skip_synchronize():
                optimizer.step()
            step = dict(t0=t0, forward=forward, backward=backward, synchronized=synchronized,
                        end=time.perf_counter(), cpu=time.process_time() - cpu,
                        events=list(EVENTS))
            if number >= 3:
                mine[name].append(summary(step))
    every = hvd_trainer.allgather_object(mine)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"imported": hvd_trainer.__file__, "ranks": every}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bed", default="1gbit", help="the link's rate (tc tbf), or bare")
    parser.add_argument("--codecs", nargs="+", default=["none", "fp16"],
                        help="of compressed_step.CODECS")
    parser.add_argument("--against", metavar="REV", help="also trace REV's tree")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    import slow_link
    from common import extract_tree
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="step_trace.") as old:
        trees = {"this tree": os.path.dirname(HERE)}
        if args.against:
            extract_tree(args.against, old)
            trees[args.against] = old
        with slow_link.two_hosts("step_trace") as bed:
            slow_link.shape(bed, None if args.bed == "bare" else args.bed, 0.0)
            for label, tree in trees.items():
                load = os.getloadavg()[0]
                result = slow_link.bed_result(bed, ["-np", "2", "-H", "h1:1,h2:1"], __file__,
                                              args.codecs, {"PYTHONPATH": tree}, "step_trace")
                print(f"# {label} ({result['imported']}), load average {load:.1f}")
                for rank, codecs in enumerate(result["ranks"]):
                    for codec, steps in codecs.items():
                        for figures in steps:
                            print(f"{codec} rank {rank}: " + ", ".join(
                                f"{k} {v:.0f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
