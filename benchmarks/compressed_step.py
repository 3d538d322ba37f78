"""The PyTorch step compressed and not, this tree against commit REV, launches interleaved.

Run:  python benchmarks/compressed_step.py --against REV [--rounds 5] [--local] [--bed RATES]
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
ratio of the medians.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

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


def checked(result: dict, tree: str) -> Dict[str, float]:
    """The per-codec seconds of a launch's ``result``, after checking it imported ``tree``."""
    if not result["imported"].startswith(os.path.join(tree, "")):
        raise RuntimeError(f"the ranks imported {result['imported']}, not the hvd_trainer of "
                           f"{tree}")
    return result["seconds"]


def local_launch(tree: str) -> Dict[str, float]:
    """One 2-rank launch on this machine with ``tree``'s hvd_trainer."""
    return checked(launch(__file__, 2, ["--worker", *CODECS], env={"PYTHONPATH": tree}), tree)


def bed_launch(bed, tree: str) -> Dict[str, float]:
    """One 2-rank launch across the bed's h1 and h2 with ``tree``'s hvd_trainer."""
    import slow_link
    return checked(slow_link.bed_result(bed, ["-np", "2", "-H", "h1:1,h2:1"], __file__,
                                        list(CODECS), {"PYTHONPATH": tree},
                                        "compressed_step launch"), tree)


def rounds_of(launch, trees: Dict[str, str], rounds: int, what: str
              ) -> Dict[str, Dict[str, List[float]]]:
    """``rounds`` launches of each tree, alternating (tree -> codec -> seconds per round)."""
    times: Dict[str, Dict[str, List[float]]] = {t: {c: [] for c in CODECS} for t in trees}
    for n in range(rounds):
        order = list(trees) if n % 2 == 0 else list(trees)[::-1]
        for label in order:
            got = launch(trees[label])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5, help="launches per tree and setting")
    parser.add_argument("--local", action="store_true", help="2 ranks on this machine")
    parser.add_argument("--bed", metavar="RATES", default=None,
                        help="rates on the 2-host bed, e.g. 1gbit or bare,1gbit (root)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
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
            times = rounds_of(local_launch, trees, args.rounds, "local")
            lines += table(times, args.against, "one host")
        if args.bed:
            import slow_link
            rates = args.bed.split(",")
            with slow_link.two_hosts("compressed_step") as bed:
                for rate in rates:
                    slow_link.shape(bed, None if rate == "bare" else rate, 0.0)
                    times = rounds_of(lambda tree: bed_launch(bed, tree), trees, args.rounds,
                                      rate)
                    lines += table(times, args.against, f"2 hosts, {rate}")
    print(header("Compressed torch steps, 8 x Linear(2048), batch 64, 2 ranks",
                 f"{args.against} against {commit()} (this tree), {args.rounds} launches each, "
                 f"alternating; load average {load:.1f} at the start, "
                 f"{os.getloadavg()[0]:.1f} at the end"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
