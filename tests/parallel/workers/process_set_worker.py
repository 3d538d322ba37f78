"""Process sets agree like collectives: registration, names, root ranks.

Stages (all by default; run as worker.py [stage ...]):
add     add_process_set / remove_process_set that differ on one rank raise on every rank,
        and later registrations still work
names   unnamed collectives on a set without rank 0, then unnamed global ones
root    root_rank is a global rank on a process set: the set [1..N-1] broadcasts from the
        last rank; root 0 (not a member) raises on every member
Results are checked against NumPy.
"""

import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases

R, N = hvd.rank(), hvd.size()
last = N - 1
failures = []


def vec(r):
    return np.arange(5, dtype=np.float64) * (r + 1)


def equal(label, got, want):
    if not (isinstance(got, np.ndarray) and got.shape == want.shape
            and np.array_equal(got, want)):
        failures.append(f"{label}: got {got!r}, want {want!r}")


def expect(label, kind, words, call, process_set=hvd.global_process_set):
    """``call()`` must raise ``kind`` with ``words`` on this rank, and the same on every rank
    of ``process_set``."""
    message = None
    try:
        call()
        failures.append(f"{label}: rank {R} raised nothing")
    except Exception as e:  # noqa: BLE001 - the type is checked just below
        message = f"{type(e).__name__}: {e}"
        if type(e) is not kind:
            failures.append(f"{label}: rank {R} raised {message}, not {kind.__name__}")
        missing = [w for w in words if w not in str(e)]
        if missing:
            failures.append(f"{label}: {message!r} lacks {missing}")
    messages = hvd.allgather_object(message, process_set=process_set)
    if len(set(messages)) != 1:
        failures.append(f"{label}: ranks raised different errors {messages}")


def stage_add():
    expect("add_process_set with other ranks on the last rank", hvd.MismatchError,
           ["add_process_set", "ranks disagree on ranks", f"rank {last}: [{last}]"],
           lambda: hvd.add_process_set([last] if R == last else [0]))
    expect("add_process_set with a rank past the end on the last rank", ValueError,
           [f"on rank {last}", f"[0, {N}]"],
           lambda: hvd.add_process_set([0, N] if R == last else [0]))
    expect("add_process_set with a fraction on the last rank", TypeError,
           [f"on rank {last}", f"ranks must be integers, got {last + 0.25} (float)"],
           lambda: hvd.add_process_set([last + 0.25] if R == last else [last]))
    first, second = hvd.add_process_set([0]), hvd.add_process_set([last])
    ids = hvd.allgather_object((first.process_set_id, second.process_set_id))
    if len(set(ids)) != 1:
        failures.append(f"process set ids differ between ranks: {ids}")
    if second.included():
        equal("allreduce on the set of the last rank",
              hvd.allreduce(vec(R), op=hvd.Sum, process_set=second), vec(last))
    expect("remove_process_set of different sets", hvd.MismatchError,
           ["remove_process_set", "ranks disagree on process_set_id"],
           lambda: hvd.remove_process_set(first if R == 0 else second))
    removed = [hvd.remove_process_set(first), hvd.remove_process_set(second),
               hvd.remove_process_set(second)]
    if removed != [True, True, False]:
        failures.append(f"remove_process_set gave {removed}, want [True, True, False]")


def stage_names():
    tail = hvd.add_process_set(list(range(1, N)))
    members = range(1, N)
    if tail.included():
        equal("unnamed allreduce on the set",
              hvd.allreduce(vec(R), op=hvd.Sum, process_set=tail),
              sum(vec(r) for r in members))
        equal("unnamed allgather on the set", hvd.allgather(vec(R), process_set=tail),
              np.concatenate([vec(r) for r in members]))
        equal("unnamed alltoall on the set",
              hvd.alltoall(np.repeat(vec(R), len(members)), process_set=tail),
              np.concatenate([np.repeat(vec(r), len(members))[5 * (R - 1):5 * R]
                              for r in members]))
    # The ranks outside the set have made none of these calls: unnamed global collectives
    # must still get the same names on every rank.
    equal("unnamed allreduce on the world", hvd.allreduce(vec(R), op=hvd.Sum),
          sum(vec(r) for r in range(N)))
    equal("unnamed broadcast on the world", hvd.broadcast(vec(R), root_rank=last), vec(last))
    equal("unnamed allgather on the world", hvd.allgather(vec(R)),
          np.concatenate([vec(r) for r in range(N)]))
    hvd.remove_process_set(tail)


def stage_root():
    tail = hvd.add_process_set(list(range(1, N)))
    if tail.included():
        equal("broadcast on [1..N-1] from global rank N-1",
              hvd.broadcast(vec(R), root_rank=last, name="b", process_set=tail), vec(last))
        inplace = vec(R)
        hvd.broadcast_(inplace, root_rank=last, name="b_", process_set=tail)
        equal("broadcast_ on [1..N-1] from global rank N-1", inplace, vec(last))
        got = hvd.broadcast_object({"rank": R}, root_rank=last, process_set=tail)
        if got != {"rank": last}:
            failures.append(f"broadcast_object on the set from rank {last} gave {got}")
        expect("broadcast from rank 0, outside the set", ValueError,
               ["root_rank=0", f"global ranks {list(range(1, N))}"],
               lambda: hvd.broadcast(vec(R), root_rank=0, process_set=tail), tail)
        if N > 2:  # an argument error on a set names the global rank
            expect("bad op on the last rank of the set", ValueError,
                   [f"on rank {last}", "op='max'"],
                   lambda: hvd.allreduce(vec(R), op="max" if R == last else hvd.Sum,
                                         process_set=tail), tail)
        equal("allreduce on the set after the error",
              hvd.allreduce(vec(R), op=hvd.Sum, process_set=tail),
              sum(vec(r) for r in range(1, N)))
    if N > 2:
        pair = hvd.add_process_set([0, last])
        if pair.included():
            equal("broadcast on [0, N-1] from global rank N-1",
                  hvd.broadcast(vec(R), root_rank=last, process_set=pair), vec(last))
        hvd.remove_process_set(pair)
    hvd.remove_process_set(tail)


run_cases({"add": stage_add, "names": stage_names, "root": stage_root}, failures, R)
