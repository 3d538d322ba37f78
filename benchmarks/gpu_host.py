"""Host time of a GPU allreduce call and of packing tensors into a device bucket: the Python
that runs while a GPU waits for work (issue 51), on CuPy or on its CPU stand-in.

    PYTHONPATH=tests/gpu/standin python benchmarks/gpu_host.py     # the stand-in
    python benchmarks/gpu_host.py                                  # CuPy on a GPU
    hvdrun -np 2 python benchmarks/gpu_host.py                     # with the agreement's exchange
    ... --profile                                                  # where the time goes
    ... --tf                                                       # TensorFlow GPU tensors
    ... --against REV [--launches N]         # this tree against commit REV, one rank
    ... --figures                            # what --against compares, this tree only

``--against`` runs this script's measurements in fresh processes, this tree's and REV's (its
hvd_trainer first on PYTHONPATH; the same stand-in for both) in turn, N launches each, and
prints each figure's median and range over the launches, in this thread's CPU µs (robust to
other processes' load). On the stand-in it also splits the calls at the stand-in's
boundary (standin_time.py): the part outside it is what hvd_trainer and the interpreter do,
which a GPU machine runs as it is; the part inside stands for CuPy's compiled code and the
CUDA driver, which only a GPU can time.

Each row times calls whose device work the host does not wait for: the stand-in runs none of
it in the timed loop (its streams run when waited for, after each round), a GPU runs it
meanwhile (a round's calls do not fill its queue). Rounds interleave ours and the reference;
median and range over rounds, in µs per call. The reference is NCCL's own ``allReduce``
through CuPy on a tensor of the same size (the stand-in's NCCL on the stand-in): the host work
any call needs. On the stand-in, CuPy's own host work (a kernel launch, an event) is the
stand-in's Python, slower than CuPy's compiled code: ``--profile`` shows which part of the
time is hvd_trainer's (profiled in CPU time, each call paying cProfile's own cost).
"""
import argparse
import cProfile
import datetime
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import cupy
from cupy.cuda import nccl as raw

import hvd_trainer as hvd
from hvd_trainer import cuda
from hvd_trainer.cuda import fusion

import common
import standin_time

STANDIN = cupy.__version__.endswith("+standin")
TENSORS, ELEMENTS = 100, 1024  # a bucket of 100 small float32 tensors (400 KiB)


class Reference:
    """NCCL's own communicator of the job's ranks and a stream of its own."""

    def __init__(self):
        uid = hvd.broadcast_object(raw.get_unique_id() if hvd.rank() == 0 else None, 0, "uid")
        self.comm = raw.NcclCommunicator(hvd.size(), uid, hvd.rank())
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def allreduce(self, x: cupy.ndarray) -> None:
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, raw.NCCL_FLOAT32, raw.NCCL_SUM,
                            self.stream.ptr)


def per_call(fn: Callable[[], object], calls: int,
             streams: List[cupy.cuda.Stream]) -> Tuple[float, float]:
    """Seconds per ``fn()``, of wall time and of this thread's CPU time; the device work it
    queued is waited for after the timing."""
    tic, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    elapsed, used = time.perf_counter() - tic, time.thread_time() - cpu
    for stream in streams:
        stream.synchronize()
    return elapsed / calls, used / calls


def interleaved(variants: Dict[str, Callable[[], object]], calls: int, rounds: int,
                streams: List[cupy.cuda.Stream]) -> Dict[str, List[float]]:
    """µs per call of each variant, the variants in turn in each round; under "<name> cpu",
    this thread's CPU time (on a loaded machine, what the host work itself takes)."""
    times: Dict[str, List[float]] = defaultdict(list)
    for fn in variants.values():
        per_call(fn, 3, streams)  # warm-up: kernels built, buffers and tables made
    for _ in range(rounds):
        for name, fn in variants.items():
            wall, cpu = per_call(fn, calls, streams)
            times[name].append(wall * 1e6)
            times[f"{name} cpu"].append(cpu * 1e6)
    return times


def cell(samples: List[float]) -> str:
    digits = 1 if statistics.median(samples) >= 10 else 2
    return f"{statistics.median(samples):.{digits}f} ({min(samples):.{digits}f}–" \
        f"{max(samples):.{digits}f})"


def call_rows(reference: Optional[Reference], calls: int, rounds: int,
              streams: List[cupy.cuda.Stream]) -> List[str]:
    """One allreduce of a tensor on the GPU, and one grouped allreduce of a bucket of 100."""
    rows = ["| call | ours µs | ours, CPU µs | NCCL's own µs | ours − NCCL's µs | "
            "per tensor µs |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    cases = [(f"allreduce_, {mib} MiB", [cupy.zeros(mib << 18, cupy.float32)], mib << 18)
             for mib in (1, 16)]
    cases.append((f"grouped_allreduce_, {TENSORS} × {ELEMENTS * 4 // 1024} KiB",
                  [cupy.zeros(ELEMENTS, cupy.float32) for _ in range(TENSORS)],
                  TENSORS * ELEMENTS))
    for label, tensors, elements in cases:
        variants = {"ours": (lambda t=tensors: cuda.grouped_allreduce_(t, hvd.Sum, "host"))
                    if len(tensors) > 1 else (lambda t=tensors[0]: cuda.allreduce_(t, hvd.Sum,
                                                                                   "host"))}
        if reference is not None:
            flat = cupy.zeros(elements, cupy.float32)
            variants["nccl"] = lambda f=flat: reference.allreduce(f)
        times = interleaved(variants, calls, rounds, streams)
        ours = statistics.median(times["ours"])
        mine = f"| {label} | {cell(times['ours'])} | {cell(times['ours cpu'])} |"
        if reference is None:
            rows.append(f"{mine} - | - | - |")
            continue
        extra = ours - statistics.median(times["nccl"])
        each = f"{extra / len(tensors):.2f}" if len(tensors) > 1 else "-"
        rows.append(f"{mine} {cell(times['nccl'])} | {extra:.1f} | {each} |")
    return rows


def pack_rows(calls: int, rounds: int, streams: List[cupy.cuda.Stream]) -> List[str]:
    """Packing 1 and 100 tensors into a bucket and back (one kernel each way, the pointer
    table cached), and the cost per tensor."""
    many = [cupy.zeros(ELEMENTS, cupy.float32) for _ in range(TENSORS)]
    bucket = cupy.empty(TENSORS * ELEMENTS, cupy.float32)
    one = [cupy.zeros(TENSORS * ELEMENTS, cupy.float32)]
    variants = {"pack 1": lambda: fusion.pack(one, bucket),
                f"pack {TENSORS}": lambda: fusion.pack(many, bucket),
                "unpack 1": lambda: fusion.unpack(bucket, one),
                f"unpack {TENSORS}": lambda: fusion.unpack(bucket, many)}
    times = interleaved(variants, calls, rounds, streams)
    rows = ["| step | 1 tensor µs | 100 tensors µs | per tensor µs | per tensor, CPU µs |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for step in ("pack", "unpack"):
        a, b = times[f"{step} 1"], times[f"{step} {TENSORS}"]
        each = (statistics.median(b) - statistics.median(a)) / (TENSORS - 1)
        cpu = (statistics.median(times[f"{step} {TENSORS} cpu"])
               - statistics.median(times[f"{step} 1 cpu"])) / (TENSORS - 1)
        rows.append(f"| {step} | {cell(a)} | {cell(b)} | {each:.2f} | {cpu:.2f} |")
    return rows


def tf_rows(calls: int, rounds: int, streams: List[cupy.cuda.Stream]) -> List[str]:
    """hvd_trainer.tensorflow's eager allreduce of a 1 MiB GPU tensor: through DLPack, and
    through a host copy (the route before DLPack; bridge.gpu_array turned off), and of a
    host tensor; TensorFlow waits for each result, so these include the GPU work."""
    import tensorflow as tf
    import hvd_trainer.tensorflow as hvd_tf
    from hvd_trainer.tensorflow import bridge
    if not tf.config.list_physical_devices("GPU"):
        return ["TensorFlow sees no GPU here: no TensorFlow row"]
    with tf.device(f"GPU:{cuda.device()}"):
        gpu = tf.zeros([1 << 18])
    host = tf.zeros([1 << 18])
    dlpack = bridge.gpu_array

    def copied() -> object:
        bridge.gpu_array = lambda value: None
        try:
            return hvd_tf.allreduce(gpu, op=hvd_tf.Sum, name="tf.copied")
        finally:
            bridge.gpu_array = dlpack

    times = interleaved({"dlpack": lambda: hvd_tf.allreduce(gpu, op=hvd_tf.Sum, name="tf.gpu"),
                         "copied": copied,
                         "host": lambda: hvd_tf.allreduce(host, op=hvd_tf.Sum, name="tf.host")},
                        calls, rounds, streams)
    return ["| TensorFlow allreduce, 1 MiB | GPU tensor, DLPack µs | GPU tensor, host copy µs "
            "| host tensor µs |", "| --- | ---: | ---: | ---: |",
            f"| eager | {cell(times['dlpack'])} | {cell(times['copied'])} | "
            f"{cell(times['host'])} |"]


def area(filename: str) -> str:
    """Where a profiled function lives: an hvd_trainer module, CuPy, or the rest."""
    path = filename.replace(os.sep, "/")
    if "/hvd_trainer/" in path:
        return "hvd_trainer." + path.split("/hvd_trainer/")[1][:-3].replace("/", ".")
    if "/cupy" in path or "/cupyx" in path:
        return "CuPy stand-in" if STANDIN else "CuPy"
    return "NumPy, mpi4py, Python"


def profile_rows(fn: Callable[[], object], calls: int) -> List[str]:
    """Own time (cProfile's tottime, in this thread's CPU time, so that other processes on
    a loaded machine do not count) of ``calls`` calls by area, largest first, and the
    functions that take the most."""
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    cupy.cuda.get_current_stream().synchronize()
    stats = pstats.Stats(profiler).stats
    total = sum(s[2] for s in stats.values())
    by_area: Dict[str, float] = defaultdict(float)
    for (filename, _, _), s in stats.items():
        by_area[area(filename)] += s[2]
    rows = ["| where | µs per call | share |", "| --- | ---: | ---: |"]
    for name, seconds in sorted(by_area.items(), key=lambda kv: -kv[1])[:12]:
        rows.append(f"| {name} | {seconds / calls * 1e6:.1f} | {seconds / total:.0%} |")
    rows += ["", "| function | µs per call | calls per call |", "| --- | ---: | ---: |"]
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    for (filename, line, name), s in top:
        rows.append(f"| {area(filename)}:{line} {name} | {s[2] / calls * 1e6:.1f} | "
                    f"{s[1] / calls:g} |")
    return rows


def figures(reference: Optional[Reference], calls: int, rounds: int,
            streams: List[cupy.cuda.Stream]) -> Dict[str, float]:
    """What ``--against`` compares, for the tree imported here: medians over ``rounds`` of
    CPU µs per call, per packed tensor, and (on the stand-in) outside the stand-in."""
    x = cupy.zeros(1 << 18, cupy.float32)
    group = [cupy.zeros(ELEMENTS, cupy.float32) for _ in range(TENSORS)]
    bucket = cupy.empty(TENSORS * ELEMENTS, cupy.float32)
    one = [cupy.zeros(TENSORS * ELEMENTS, cupy.float32)]
    variants = {"allreduce_ 1 MiB": lambda: cuda.allreduce_(x, hvd.Sum, "host"),
                f"grouped_allreduce_ {TENSORS}": lambda: cuda.grouped_allreduce_(group, hvd.Sum,
                                                                                  "host"),
                "pack 1": lambda: fusion.pack(one, bucket),
                f"pack {TENSORS}": lambda: fusion.pack(group, bucket),
                "unpack 1": lambda: fusion.unpack(bucket, one),
                f"unpack {TENSORS}": lambda: fusion.unpack(bucket, group)}
    if reference is not None:
        variants["NCCL's own allReduce 1 MiB"] = lambda: reference.allreduce(x)
    times = interleaved(variants, calls, rounds, streams)
    out = {name: statistics.median(times[f"{name} cpu"]) for name in variants}
    for step in ("pack", "unpack"):
        out[f"{step}, per tensor"] = (out.pop(f"{step} {TENSORS}") - out.pop(f"{step} 1")) \
            / (TENSORS - 1)
    if STANDIN:
        def settle() -> None:
            for stream in streams:
                stream.synchronize()
        # Not for the grouped call: its 1,200 stand-in calls would multiply the timers' own
        # cost, which is known to a fraction of a µs only, by as many.
        for name in ("allreduce_ 1 MiB", "NCCL's own allReduce 1 MiB")[:len(streams)]:
            splits = [standin_time.outside(variants[name], calls, settle)
                      for _ in range(rounds)]
            out[f"{name}, outside the stand-in"] = statistics.median(s.outside for s in splits)
            out[f"{name}, stand-in calls"] = statistics.median(s.entries for s in splits)
    return out


def against(rev: str, launches: int, calls: int, rounds: int) -> List[str]:
    """This tree's figures and ``rev``'s, from fresh one-rank processes in turn."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: Dict[str, List[Dict[str, float]]] = defaultdict(list)
    with common.detached_tree(rev) as old:
        trees = {rev: old, "this tree": here}
        for _ in range(launches):
            for label, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--figures",
                                      "--calls", str(calls), "--rounds", str(rounds)],
                                     capture_output=True, text=True, env=env, timeout=600)
                found = re.search(r"RESULT (\{.*\})", out.stdout)
                if out.returncode or not found:
                    raise RuntimeError(f"{label}: exit {out.returncode}\n{out.stdout}{out.stderr}")
                result = json.loads(found.group(1))
                if not result.pop("file").startswith(tree):
                    raise RuntimeError(f"{label}'s process imported another hvd_trainer")
                runs[label].append(result)
    rows = [f"| CPU µs, median (range) of {launches} launches | {rev} | this tree | "
            f"this tree − {rev} |", "| --- | ---: | ---: | ---: |"]
    for name in runs["this tree"][0]:
        cells = [[run[name] for run in runs[label]] for label in trees]
        rows.append(f"| {name} | {cell(cells[0])} | {cell(cells[1])} | "
                    f"{statistics.median(cells[1]) - statistics.median(cells[0]):+.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="also profile the calls")
    parser.add_argument("--tf", action="store_true",
                        help="also TensorFlow's GPU tensors (needs TensorFlow with a GPU)")
    parser.add_argument("--against", metavar="REV",
                        help="compare with commit REV, launches in turn (one rank)")
    parser.add_argument("--launches", type=int, default=5, help="launches per tree")
    parser.add_argument("--figures", action="store_true",
                        help="only the figures --against compares, for this tree")
    args = parser.parse_args()
    if args.against:
        print(f"# {'CPU stand-in' if STANDIN else 'CuPy ' + cupy.__version__} · 1 rank · "
              f"{datetime.date.today().isoformat()} · load {os.getloadavg()[0]:.1f}\n")
        print("\n".join(against(args.against, args.launches, args.calls, args.rounds)))
        print(f"\nload at the end {os.getloadavg()[0]:.1f}")
        return
    hvd.init()
    cupy.cuda.Device(cuda.device()).use()
    comm = cuda.communicator()
    reference = Reference() if type(comm).__name__ == "NCCLCommunicator" else None
    streams = [cupy.cuda.get_current_stream()] + ([reference.stream] if reference else [])
    if args.figures:
        result = figures(reference, args.calls, args.rounds, streams)
        rows = ["| this thread's CPU µs (median of rounds) | |", "| --- | ---: |"]
        rows += [f"| {name} | {value:.2f} |" for name, value in result.items()]
        print("\n".join(rows + ["", f"RESULT {json.dumps(dict(result, file=hvd.__file__))}"]),
              flush=True)
        return
    out = [f"# {'CPU stand-in' if STANDIN else 'CuPy ' + cupy.__version__} · "
           f"{type(comm).__name__} · {hvd.size()} rank(s) · "
           f"{datetime.date.today().isoformat()} · load {os.getloadavg()[0]:.1f}", ""]
    out += call_rows(reference, args.calls, args.rounds, streams) + [""]
    out += pack_rows(args.calls, args.rounds, streams)
    if args.tf:
        out += [""] + tf_rows(args.calls // 10, args.rounds, streams)
    if args.profile:
        x = cupy.zeros(1 << 18, cupy.float32)
        group = [cupy.zeros(ELEMENTS, cupy.float32) for _ in range(TENSORS)]
        out += ["", "Profile: allreduce_ of 1 MiB", ""]
        out += profile_rows(lambda: cuda.allreduce_(x, hvd.Sum, "host"), args.calls)
        out += ["", f"Profile: grouped_allreduce_ of {TENSORS} tensors", ""]
        out += profile_rows(lambda: cuda.grouped_allreduce_(group, hvd.Sum, "host"), args.calls)
    if hvd.rank() == 0:
        print("\n".join(out), flush=True)


if __name__ == "__main__":
    main()
