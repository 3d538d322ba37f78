"""The codecs' CPU time per 2048 x 2048 float32 gradient, this tree against commit REV.

Run:  python benchmarks/codec_kernels.py --against REV [--rounds 3]

One process per tree and round (REV's ``hvd_trainer`` from ``git archive``, imported through
PYTHONPATH and checked by path), trees alternating, one thread, one process (no ranks: the
collectives of one process are copies). Per gradient of the MLP of compressed_step.py, CPU
ms (``time.process_time``, the best of 15 calls, then the median over the rounds): 2-bit
(threshold 0.5) encode with its residual, the decode of 2 ranks' 2-bit payloads
(``feedback.decode_sum``, what every rank does after the allgather), top-k 0.01 encode, and
PowerSGD rank 4's whole sum on one rank (factors, QR, approximation, residual).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import commit, extract_tree, header  # noqa: E402

SIDE, CALLS = 2048, 15
PARTS = ("2-bit encode", "2-bit decode, 2 ranks", "top-k 0.01 encode", "PowerSGD rank 4 sum")


def best_ms(work: Callable[[], None]) -> float:
    """The least CPU time of ``CALLS`` calls of ``work``, in ms."""
    times = []
    for _ in range(CALLS):
        tic = time.process_time()
        work()
        times.append(time.process_time() - tic)
    return min(times) * 1e3


def worker() -> None:
    """Time each part on this process's hvd_trainer; print the tree and the figures."""
    import numpy as np

    import hvd_trainer
    from hvd_trainer import compression
    from hvd_trainer.collectives.feedback import decode_sum
    from hvd_trainer.collectives.powersgd import PowerSGD, PowerSGDSum

    hvd_trainer.init()
    rng = np.random.default_rng(0)
    grad = (rng.standard_normal(SIDE * SIDE) * 0.3).astype(np.float32)
    two_bit, top_k = compression.TwoBit(0.5), compression.TopK(0.01)
    residual = np.zeros_like(grad)
    payloads = np.stack([two_bit.encode(grad, residual) for _ in range(2)])
    out = np.empty_like(grad)
    powersgd = PowerSGDSum(PowerSGD(rank=4, start_iter=0))
    matrix = np.empty((SIDE, SIDE), np.float32)

    def factored() -> None:
        matrix.reshape(-1)[...] = grad
        powersgd.sum_([("w", matrix)], "w")

    figures = {PARTS[0]: best_ms(lambda: two_bit.encode(grad, residual)),
               PARTS[1]: best_ms(lambda: decode_sum(two_bit, payloads,
                                                    [0, payloads.shape[1]], [out], 1.0)),
               PARTS[2]: best_ms(lambda: top_k.encode(grad, residual)),
               PARTS[3]: best_ms(factored) - best_ms(lambda: matrix.reshape(-1).__setitem__(
                   Ellipsis, grad))}
    print("RESULT", hvd_trainer.__file__, *(f"{figures[p]:.3f}" for p in PARTS), flush=True)


def run(tree: str) -> Dict[str, float]:
    """One worker process on ``tree``'s hvd_trainer; its figures by part."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], cwd=tree,
                         env=env, capture_output=True, text=True, timeout=600)
    line = [w for w in out.stdout.splitlines() if w.startswith("RESULT ")]
    if out.returncode or not line:
        raise RuntimeError(f"codec_kernels worker exited {out.returncode}\n{out.stderr}")
    words = line[-1].split()
    if not words[1].startswith(os.path.join(tree, "")):
        raise RuntimeError(f"the worker imported {words[1]}, not the hvd_trainer of {tree}")
    return dict(zip(PARTS, map(float, words[2:])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="processes per tree")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    if not args.against:
        parser.error("give --against REV")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="codec_kernels.") as old:
        extract_tree(args.against, old)
        trees = {"before": old, "after": REPO}
        got: Dict[str, List[Dict[str, float]]] = {label: [] for label in trees}
        for n in range(args.rounds):
            for label in (list(trees) if n % 2 == 0 else list(trees)[::-1]):
                got[label].append(run(trees[label]))
    print(header("Codec CPU time per 2048 x 2048 float32 gradient, one core",
                 f"{args.against} against {commit()} (this tree), {args.rounds} processes "
                 f"each, alternating; load average {load:.1f} at the start, "
                 f"{os.getloadavg()[0]:.1f} at the end"))
    print(f"| part | {args.against} ms | this tree ms | after / before |\n|---|---|---|---|")
    for part in PARTS:
        before, after = (statistics.median(r[part] for r in got[label])
                         for label in ("before", "after"))
        print(f"| {part} | {before:.2f} | {after:.2f} | {after / before:.2f} |")


if __name__ == "__main__":
    main()
