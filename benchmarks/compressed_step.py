"""The PyTorch step compressed and not, this tree against commit REV, launches interleaved.

Run:  python benchmarks/compressed_step.py --against REV [--rounds 5] [--local [--one-bucket]]
          [--bed RATES] [--floor]
      (--bed needs root: the 2-host test bed of tests/multihost/testbed.py)

The step is that of slow_link.py and powersgd_link.py: the 8 x Linear(2048) MLP, batch 64 per
rank, SGD with momentum, one thread per rank, ``DistributedOptimizer`` with no compression,
``Compression.fp16``, 2-bit (threshold 0.5), top-k 0.01 and PowerSGD (rank 4, from step 2),
all in one launch of 2 ranks; each codec's time is the median of its repetitions (the slowest
rank's). ``--local`` runs the 2 ranks on this machine; ``--bed 1gbit`` across two test-bed
hosts with both hosts' lan0 shaped by tc tbf at each rate (``bare`` for the unshaped veth
link). Per setting, rounds alternate REV's tree (``git archive REV hvd_trainer``, imported
through PYTHONPATH; each launch checks which hvd_trainer its ranks imported) and this one, so
both see the same load; the table gives each tree's median and range over the rounds and the
ratio of the medians. ``--one-bucket`` adds, on one host, this tree with every gradient in
one bucket reduced after backward; ``--floor`` times the step's parts alone (forward,
backward, update, the weight buckets' transfers) and the lower bound they set.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import commit, extract_tree, header, launch, report  # noqa: E402

CODECS = ("none", "fp16", "2-bit", "top-k 0.01", "powersgd")
BATCH, WIDTH, LAYERS = 64, 2048, 8
WARMUP, REPETITIONS, STEPS = 3, 3, 2  # warmup past PowerSGD's 2 exact steps


def compressor(name: str) -> object:
    """The ``compression=`` argument for codec ``name``."""
    import hvd_trainer.torch as hvd
    from hvd_trainer import compression
    return {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
            "2-bit": compression.TwoBit(0.5), "top-k 0.01": compression.TopK(0.01),
            "powersgd": hvd.Compression.powersgd(rank=4, start_iter=2)}[name]


def worker(codecs: List[str]) -> None:
    """One rank of a 2-rank launch: the median step of each codec, printed by rank 0."""
    import torch

    import hvd_trainer
    import hvd_trainer.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    results = {}
    for name in codecs:
        torch.manual_seed(0)
        layers = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
            named_parameters=[(f"{name}.{n}", p) for n, p in net.named_parameters()],
            compression=compressor(name))
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        x, y = torch.rand(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))

        def step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()

        for _ in range(WARMUP):
            step()
        times = []
        for _ in range(REPETITIONS):
            hvd.barrier()
            tic = time.perf_counter()
            for _ in range(STEPS):
                step()
            mine = (time.perf_counter() - tic) / STEPS
            times.append(hvd.allreduce(torch.tensor([mine]), op=hvd.Max).item())
        results[name] = statistics.median(times)
    if hvd.rank() == 0:
        report({"imported": hvd_trainer.__file__, "seconds": results})


def floor_worker() -> None:
    """One rank of the floor launch: what bounds the step from below, each part alone (ms,
    the median of 5 repetitions, the slowest rank's): forward, backward, the SGD update, and
    the transfers of the 8 weight buckets as the step makes them (8 ring allreduces of 4 Mi
    float16 for fp16, of float32 for none, 8 allgathers of their 1 MiB 2-bit payloads)."""
    import numpy as np
    import torch

    import hvd_trainer
    import hvd_trainer.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.rand(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    weights = WIDTH * WIDTH
    halves = [torch.zeros(weights, dtype=torch.float16) for _ in range(LAYERS)]
    singles = [torch.zeros(weights) for _ in range(LAYERS)]
    payload = np.zeros(weights // 4, np.uint8)
    parts: Dict[str, List[float]] = {p: [] for p in ("forward", "backward", "update",
                                                     "fp16 wire", "none wire", "2-bit wire")}

    def timed(part: str, work) -> None:
        hvd.barrier()
        tic = time.perf_counter()
        work()
        mine = time.perf_counter() - tic
        parts[part].append(hvd.allreduce(torch.tensor([mine]), op=hvd.Max).item())

    for repetition in range(WARMUP + 5):
        optimizer.zero_grad()
        loss = []
        timed("forward", lambda: loss.append(torch.nn.functional.cross_entropy(net(x), y)))
        timed("backward", lambda: loss[0].backward())
        timed("update", optimizer.step)
        timed("fp16 wire", lambda: [hvd.allreduce_(t, op=hvd.Sum) for t in halves])
        timed("none wire", lambda: [hvd.allreduce_(t, op=hvd.Sum) for t in singles])
        timed("2-bit wire", lambda: [hvd_trainer.allgather(payload) for _ in range(LAYERS)])
    if hvd.rank() == 0:
        report({"imported": hvd_trainer.__file__,
                "floor": {p: statistics.median(t[WARMUP:]) for p, t in parts.items()}})


def checked(result: dict, tree: str) -> Dict[str, float]:
    """The per-codec seconds of a launch's ``result``, after checking it imported ``tree``
    (None for a floor launch)."""
    if not result["imported"].startswith(os.path.join(tree, "")):
        raise RuntimeError(f"the ranks imported {result['imported']}, not the hvd_trainer of "
                           f"{tree}")
    return result.get("seconds")


# --one-bucket: this tree again with a bucket threshold above the model's 134 MB of
# gradients, so that one bucket is reduced after backward, as b87c4df reduced compressed ones.
ONE_BUCKET = "this tree, one bucket"


def local_launch(label: str, tree: str) -> Dict[str, float]:
    """One 2-rank launch on this machine with ``tree``'s hvd_trainer (one bucket for the
    label ONE_BUCKET)."""
    env = {"PYTHONPATH": tree}
    if label == ONE_BUCKET:
        env["HVD_BUCKET_THRESHOLD"] = str(1 << 30)
    return checked(launch(__file__, 2, ["--worker", *CODECS], env=env), tree)


def bed_launch(bed, tree: str, codecs: Sequence[str] = CODECS) -> dict:
    """One 2-rank launch across the bed's h1 and h2 with ``tree``'s hvd_trainer (``codecs``
    or ``["floor"]``): its RESULT, after checking which hvd_trainer it imported."""
    import slow_link
    result = slow_link.bed_result(bed, ["-np", "2", "-H", "h1:1,h2:1"], __file__, list(codecs),
                                  {"PYTHONPATH": tree}, "compressed_step launch")
    checked(result, tree)
    return result


def local_floor() -> dict:
    """The floor launch (:func:`floor_worker`) on this machine, with this tree."""
    return launch(__file__, 2, ["--worker", "floor"], env={"PYTHONPATH": REPO})


def floor_table(floors: List[Dict[str, float]], times: Dict[str, Dict[str, List[float]]],
                rev: str, where: str) -> List[str]:
    """Markdown rows: each part's median over the floor launches, then for none and fp16 the
    step's lower bound in this design (forward, then every weight bucket's transfer one after
    another on the link, then the update; backward and the codecs hidden) against REV's
    median step: the smallest ratio this link allows."""
    rows = [f"| {where} | part | ms (median, range) |", "|---|---|---|"]
    median = {p: statistics.median(f[p] for f in floors) for p in floors[0]}
    for part in floors[0]:
        t = [f[part] for f in floors]
        rows.append(f"| {where} | {part} | {median[part] * 1e3:.0f} ({min(t) * 1e3:.0f}–"
                    f"{max(t) * 1e3:.0f}) |")
    for codec in ("none", "fp16"):
        bound = median["forward"] + median[f"{codec} wire"] + median["update"]
        before = statistics.median(times["before"][codec])
        rows.append(f"| {where} | {codec} step's bound: forward + wire + update | "
                    f"{bound * 1e3:.0f}, {bound / before:.2f} of {rev}'s step |")
    return rows


def rounds_of(launch, trees: Dict[str, str], rounds: int, what: str
              ) -> Dict[str, Dict[str, List[float]]]:
    """``rounds`` launches of each tree, alternating (label -> codec -> seconds per round);
    ``launch(label, tree)`` makes one."""
    times: Dict[str, Dict[str, List[float]]] = {t: {c: [] for c in CODECS} for t in trees}
    for n in range(rounds):
        order = list(trees) if n % 2 == 0 else list(trees)[::-1]
        for label in order:
            got = launch(label, trees[label])
            for codec in CODECS:
                times[label][codec].append(got[codec])
            print(f"# {what} round {n + 1} {label}: " + ", ".join(
                f"{c} {got[c] * 1e3:.0f} ms" for c in CODECS), file=sys.stderr, flush=True)
    return times


def table(times: Dict[str, Dict[str, List[float]]], rev: str, where: str) -> List[str]:
    """Markdown rows: per codec, both trees' median and range, after/before, after/none."""
    rows = [f"| {where} | codec | {rev} ms (median, range) | this tree ms (median, range) "
            "| after / before | after / after's none |", "|---|---|---|---|---|---|"]
    after_none = statistics.median(times["after"]["none"])
    for codec in CODECS:
        cells = []
        for label in ("before", "after"):
            t = times[label][codec]
            cells.append(f"{statistics.median(t) * 1e3:.0f} ({min(t) * 1e3:.0f}–"
                         f"{max(t) * 1e3:.0f})")
        ratio = statistics.median(times["after"][codec]) / statistics.median(
            times["before"][codec])
        rows.append(f"| {where} | {codec} | {cells[0]} | {cells[1]} | {ratio:.2f} | "
                    f"{statistics.median(times['after'][codec]) / after_none:.2f} |")
    return rows


def one_bucket_table(times: Dict[str, Dict[str, List[float]]], rev: str) -> List[str]:
    """Markdown rows: per codec, this tree's step with one bucket (median, range) and its
    ratio to REV's and to this tree's step in buckets."""
    rows = [f"| one host | codec | this tree, one bucket ms (median, range) | / {rev} "
            "| / this tree in buckets |", "|---|---|---|---|---|"]
    for codec in CODECS:
        t = times[ONE_BUCKET][codec]
        mid = statistics.median(t)
        rows.append(f"| one host | {codec} | {mid * 1e3:.0f} ({min(t) * 1e3:.0f}–"
                    f"{max(t) * 1e3:.0f}) | {mid / statistics.median(times['before'][codec]):.2f}"
                    f" | {mid / statistics.median(times['after'][codec]):.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5, help="launches per tree and setting")
    parser.add_argument("--local", action="store_true", help="2 ranks on this machine")
    parser.add_argument("--bed", metavar="RATES", default=None,
                        help="rates on the 2-host bed, e.g. 1gbit or bare,1gbit (root)")
    parser.add_argument("--floor", action="store_true",
                        help="also time the step's parts alone (forward, backward, update, "
                             "the weight buckets' transfers), --rounds launches of this tree, "
                             "and the lower bound they set on the none and fp16 steps")
    parser.add_argument("--one-bucket", action="store_true",
                        help="with --local, also this tree with one bucket reduced after "
                             "backward (HVD_BUCKET_THRESHOLD=1 GiB), as REV reduced compressed "
                             "gradients before issue 47")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == ["floor"]:
        floor_worker()
        return
    if args.worker:
        worker(args.worker)
        return
    if not args.against or not (args.local or args.bed):
        parser.error("give --against REV and --local and/or --bed RATES")
    lines: List[str] = []
    # Not in /tmp: the test bed's hosts each have a /tmp of their own.
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="compressed_step.") as old:
        extract_tree(args.against, old)
        trees = {"before": old, "after": REPO}
        load = os.getloadavg()[0]
        if args.local:
            local = dict(trees, **({ONE_BUCKET: REPO} if args.one_bucket else {}))
            times = rounds_of(local_launch, local, args.rounds, "local")
            lines += table(times, args.against, "one host")
            if args.one_bucket:
                lines += [""] + one_bucket_table(times, args.against)
            if args.floor:
                floors = [local_floor()["floor"] for _ in range(args.rounds)]
                lines += [""] + floor_table(floors, times, args.against, "one host")
        if args.bed:
            import slow_link
            rates = args.bed.split(",")
            with slow_link.two_hosts("compressed_step") as bed:
                for rate in rates:
                    slow_link.shape(bed, None if rate == "bare" else rate, 0.0)
                    times = rounds_of(lambda label, tree: bed_launch(bed, tree)["seconds"],
                                      trees, args.rounds, rate)
                    lines += table(times, args.against, f"2 hosts, {rate}")
                    if args.floor:
                        floors = [bed_launch(bed, REPO, ["floor"])["floor"]
                                  for _ in range(args.rounds)]
                        lines += [""] + floor_table(floors, times, args.against,
                                                    f"2 hosts, {rate}")
    print(header("Compressed torch steps, 8 x Linear(2048), batch 64, 2 ranks",
                 f"{args.against} against {commit()} (this tree), {args.rounds} launches each, "
                 f"alternating; load average {load:.1f} at the start, "
                 f"{os.getloadavg()[0]:.1f} at the end"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
