"""Where a small collective's microseconds go: its Python path alone, and its MPI exchanges alone.

One process:  python benchmarks/call_path.py [--calls 200]
On 2 ranks:   hvdrun -np 2 --no-prefix python benchmarks/call_path.py --exchanges

The first runs ``allreduce``, ``allreduce_`` and ``broadcast_`` of 4 KiB and
``broadcast_object`` of a small dict (small_collectives.py's cases) on a *mirror*: a
communicator of 2 ranks whose peer makes the same call at the same instant (each exchange
completes when it is started, the peer's record and payload a copy of this rank's). So it
times the Python path of a call that agreed at once and carried its data, with no MPI and no
wait for a peer (each case repeats one call, so from its second call on it takes the
steady-state fast path, see docs/concepts.md#agreement): the floor of ours − raw on 2 ranks, whatever the machine's load (the best
of 40 short repeats). Each call's time is split by stage, from timers around the functions that make it
(their own cost, measured on an empty function, taken off); what no timer covers is the
glue between them.

The second times, on 2 real ranks, the exchanges a carried call makes (the agreement's
208-byte record by a persistent allreduce, then the carrier's 4 KiB slot by a persistent
allgather), one allgather that would carry both, and the raw mpi4py calls they stand
beside; short rounds interleaved, a round's time its slowest rank's, the median of rounds.
Figures in docs/performance.md.
"""
import argparse
import functools
import os
import statistics
import sys
import time
import timeit
from typing import Any, Callable, Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks' own modules
from small_collectives import SMALL_DICT  # noqa: E402
# Short repeats, many: on cores shared with other jobs a long one is mostly descheduled.
REPEATS = 40


def mirror() -> Any:
    """A 2-rank communicator whose peer is this rank's mirror (see the module docstring)."""
    from hvd_trainer.backends.local import LocalCommunicator

    class Done:
        @staticmethod
        def test() -> bool:
            return True

    class Mirror(LocalCommunicator):
        size = 2

        def repeated_allgather(self, send: np.ndarray,
                               recv: np.ndarray) -> Callable[[], Any]:
            def start() -> Any:
                recv[0] = send
                recv[1] = send
                return Done
            return start

        def repeated_allreduce(self, send: np.ndarray, recv: np.ndarray,
                               op: str) -> Callable[[], Any]:
            def start() -> Any:  # the or (or max) of two equal records is the record
                recv[...] = send
                return Done
            return start

    return Mirror()


def cases() -> Dict[str, Callable[[], Any]]:
    """small_collectives.py's calls, by name (hvd_trainer initialized)."""
    import hvd_trainer as hvd
    from hvd_trainer.collectives import objects
    buf = np.ones(1024, np.float32)
    zeros = np.zeros(1024, np.float32)
    return {"allreduce 4 KiB": lambda: hvd.allreduce(buf, op=hvd.Sum),
            "allreduce_ 4 KiB": lambda: hvd.allreduce_(zeros, op=hvd.Sum),
            "broadcast_ 4 KiB": lambda: hvd.broadcast_(buf, 0),
            # objects.broadcast_object looked up at each call: the stage timer wraps it
            "broadcast_object (small dict)": lambda: objects.broadcast_object(SMALL_DICT, 0)}


class Timers:
    """Timers around named functions, each adding its calls' own time (less that of the timed
    functions it calls) to its stage."""

    def __init__(self) -> None:
        self.spent: Dict[str, int] = {}
        self.calls = 0
        self.inner = [0]  # per open timer, the time of the timed calls inside it so far

    def wrap(self, owner: Any, attribute: str, stage: str) -> None:
        """Time ``owner.attribute`` (a function or method) under ``stage``."""
        inner = getattr(owner, attribute)
        spent, nested = self.spent, self.inner
        spent.setdefault(stage, 0)
        clock = time.perf_counter_ns

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            nested.append(0)
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed = clock() - start
                spent[stage] += elapsed - nested.pop()
                nested[-1] += elapsed
        setattr(owner, attribute, timed)


def stage_timers() -> Timers:
    """Timers on the stages of a carried call (agreement.py, scheduler.py, plans.py,
    memory.py, rounds.py, records.py)."""
    from hvd_trainer.collectives import memory, plans
    from hvd_trainer.coordination import agreement, records, scheduler, stall
    timers = Timers()
    enter = "Call: enter and exit (work_order.flush; agreement.again on the fast path)"
    timers.wrap(agreement.Call, "__enter__", enter)
    timers.wrap(agreement.Call, "__exit__", enter)
    timers.wrap(agreement, "again", enter)
    timers.wrap(scheduler.Schedule, "open", "name and claim the turn (Schedule.open, open_again)")
    timers.wrap(scheduler.Schedule, "open_again",
                "name and claim the turn (Schedule.open, open_again)")
    timers.wrap(scheduler.Schedule, "forget", "release name and turn (Schedule.forget)")
    lookup = "plan lookup (plans.*_key, Known.get; Known.again on the fast path)"
    timers.wrap(plans, "reduction_key", lookup)
    timers.wrap(plans, "broadcast_key", lookup)
    timers.wrap(plans.Known, "get", lookup)
    timers.wrap(plans.Known, "again", lookup)
    timers.wrap(memory.Memory, "check", "argument checks (Memory.check)")
    timers.wrap(agreement, "signed_digest", "digest (signed_digest)")
    timers.wrap(agreement, "post_record", "agreement exchange (post_record, its poll)")
    timers.wrap(records.Carrier, "post", "carrier exchange (post, poll, read)")
    timers.wrap(stall, "poll", "carrier exchange (post, poll, read)")
    timers.wrap(records.Carrier, "gathered", "carrier exchange (post, poll, read)")
    return timers


def path_figures(calls: int) -> Dict[str, Dict[str, float]]:
    """Per call: its whole time (untimed, best of :data:`REPEATS`) and each stage's, in µs,
    on the mirror, from the timed repeat whose stages took least."""
    import hvd_trainer as hvd
    from hvd_trainer.runtime.runtime import global_process_set
    hvd.init()
    global_process_set.comm = mirror()
    run = cases()
    whole = {name: _best(fn, calls) for name, fn in run.items()}
    overhead = _timer_cost(calls)
    timers = stage_timers()
    figures = {}
    for name, fn in run.items():
        repeats = []
        for _ in range(REPEATS):
            for stage in timers.spent:
                timers.spent[stage] = 0
            timers.calls = 0
            for _ in range(calls):
                fn()
            repeats.append({stage: ns / calls / 1e3 for stage, ns in timers.spent.items()
                            if ns})
        stages = min(repeats, key=lambda r: sum(r.values()))
        figures[name] = {"whole": whole[name], "timers per call": timers.calls / calls,
                         "timer cost": overhead, **stages}
    return figures


def _timer_cost(calls: int) -> float:
    """µs that a timer adds to a call (an empty function's, timed and not)."""
    plain = _best(_nothing, calls * 10)
    timers = Timers()
    timers.wrap(sys.modules[__name__], "_nothing", "nothing")
    return _best(_nothing, calls * 10) - plain


def _nothing() -> None:
    """An empty function, timed to measure a timer's own cost."""


def _best(fn: Callable[[], Any], calls: int) -> float:
    """µs per call of ``fn``, best of :data:`REPEATS` repeats."""
    return min(timeit.repeat(fn, number=calls, repeat=REPEATS)) / calls * 1e6


def print_path(figures: Dict[str, Dict[str, float]]) -> None:
    """The tables of :func:`path_figures`."""
    for name, f in figures.items():
        timed = {k: v for k, v in f.items() if k not in ("whole", "timers per call",
                                                          "timer cost")}
        print(f"## {name}: {f['whole']:.1f} µs a call on the mirror (best of {REPEATS} repeats)")
        print("| stage | µs a call |")
        print("|---|---|")
        for stage, value in timed.items():
            print(f"| {stage} | {value:.1f} |")
        print(f"| the rest: the collective's own function (argument handling, numpy work), the "
              "agreement's glue (Call.exchange, its _agreed and _run) | "
              f"{f['whole'] - sum(timed.values()):.1f} |")
        print(f"(the stages timed apart from the whole, {f['timers per call']:.0f} timers a "
              f"call; a timer costs {f['timer cost']:.2f} µs, of which a stage holds a part, and "
              "an enclosing stage the rest)")
        print()


def exchange_figures(rounds: int, iters: int) -> Dict[str, float]:
    """Median µs of each exchange on this job's ranks (see the module docstring)."""
    from mpi4py import MPI
    import hvd_trainer as hvd
    from allreduce import timed  # seconds per call, the slowest rank's
    from hvd_trainer.coordination import records
    hvd.init()
    comm = MPI.COMM_WORLD
    words = records.RECORD_WORDS
    slot = records.PAYLOAD_AT + 4096 // 8
    send, reduced = np.zeros(words, np.int64), np.zeros(words, np.int64)
    agreement = comm.Allreduce_init(send, reduced, MPI.BOR)
    own, every = np.zeros(slot, np.int64), np.zeros((comm.size, slot), np.int64)
    carrier = comm.Allgather_init(own, every)
    both = np.zeros(words + slot, np.int64)
    both_every = np.zeros((comm.size, words + slot), np.int64)
    fused = comm.Allgather_init(both, both_every)
    buf, out = np.ones(1024, np.float32), np.empty(1024, np.float32)

    def complete(request: Any) -> None:
        request.Start()
        while not request.Test():
            pass

    run = {"raw Allreduce 4 KiB": lambda: comm.Allreduce(buf, out, MPI.SUM),
           "raw Bcast 4 KiB": lambda: comm.Bcast(buf, 0),
           f"agreement record ({send.nbytes} B allreduce)": lambda: complete(agreement),
           "carrier slot (4 KiB allgather)": lambda: complete(carrier),
           "record, then slot (a carried call now)": lambda: (complete(agreement),
                                                              complete(carrier)),
           "record and slot in one allgather": lambda: complete(fused)}
    for fn in run.values():
        for _ in range(100):
            fn()
    times: Dict[str, List[float]] = {name: [] for name in run}
    for _ in range(rounds):
        for name, fn in run.items():
            times[name].append(timed(fn, iters) * 1e6)
    for request in (agreement, carrier, fused):
        request.Free()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per repeat")
    parser.add_argument("--exchanges", action="store_true",
                        help="time the MPI exchanges (2 ranks under hvdrun)")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    if args.exchanges:
        figures = exchange_figures(args.rounds, 10)
        import hvd_trainer as hvd
        if hvd.rank() == 0:
            print("| exchange on 2 ranks | µs (median of rounds) |")
            print("|---|---|")
            for name, value in figures.items():
                print(f"| {name} | {value:.1f} |")
        return
    print_path(path_figures(args.calls))


if __name__ == "__main__":
    main()
