"""Messages larger than the MPI count limit travel in pieces, with every result unchanged.

MPI libraries without MPI-4 large counts take at most 2**31 - 1 elements per call. A buffer
that large is too slow for a test, so the limit is lowered to LIMIT on the world's
communicator and on a process set's, and each one's mpi4py communicator is wrapped to record
the largest count (or displacement) of every MPI call. Every collective is checked against
NumPy, and no call may exceed LIMIT. Run with HVD_ALLREDUCE_ALGO=auto and
HVD_RING_THRESHOLD=RING_THRESHOLD, so that small allreduces are native and large ones ring.
The world and the process set are cases of their own (case_runner.py).
"""
from collections import Counter

import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases
from hvd_trainer.runtime import runtime

LIMIT = 1000
RING_THRESHOLD = 20000  # bytes; the test sets it in the environment
R, N = hvd.rank(), hvd.size()
failures = []


def counts(spec):
    """The counts and displacements an mpi4py buffer argument hands to MPI."""
    if isinstance(spec, np.ndarray):
        return [spec.size]
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:  # [buffer, datatype]: the whole buffer
            return [spec[0].size]
        return [*spec[1], *spec[2]]  # [buffer, counts, displacements, datatype]
    return []  # MPI.IN_PLACE


class Recorder:
    """Stands in for an mpi4py communicator, recording each buffer call's largest count."""

    def __init__(self, comm):
        self.comm = comm
        self.calls = Counter()
        self.over = []

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def _record(self, name, *specs):
        largest = max((c for spec in specs for c in counts(spec)), default=0)
        self.calls[name] += 1
        if largest > LIMIT:
            self.over.append(f"{name} with count {largest}")

    def Allreduce(self, send, recv, op):
        self._record("Allreduce", send, recv)
        return self.comm.Allreduce(send, recv, op)

    def Bcast(self, buf, root=0):
        self._record("Bcast", buf)
        return self.comm.Bcast(buf, root)

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag):
        self._record("Sendrecv", sendbuf, recvbuf)
        return self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)

    def Isend(self, buf, dest, tag=0):
        self._record("Isend", buf)
        return self.comm.Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag=0):
        self._record("Irecv", buf)
        return self.comm.Irecv(buf, source, tag)

    def Allgatherv(self, send, recv):
        self._record("Allgatherv", send, recv)
        return self.comm.Allgatherv(send, recv)

    def Alltoallv(self, send, recv):
        self._record("Alltoallv", send, recv)
        return self.comm.Alltoallv(send, recv)


def data(r, shape, dtype, salt=0):
    return np.random.default_rng([r, salt, *shape]).integers(0, 9, shape).astype(dtype)


def check(label, got, want):
    if not (isinstance(got, np.ndarray) and got.dtype == want.dtype
            and got.shape == want.shape and np.array_equal(got, want)):
        failures.append(f"{label}: got {getattr(got, 'shape', got)}, want {want.shape}")


def run_all(where, ranks, process_set):
    """Every collective on ``process_set`` (the world ranks ``ranks``), against NumPy."""
    me = ranks.index(R)
    n = len(ranks)
    # 15001 float32 on 3 ranks: ring chunks of 20004 and 20000 bytes, 21 and 20 pieces.
    for count, dtype in ((3000, np.float32), (15_001, np.float32), (50_001, np.float32),
                         (20_000, np.int64), (7, np.float64)):
        for op, reduce in ((hvd.Sum, sum), (hvd.Max, lambda xs: np.max(list(xs), axis=0))):
            got = hvd.allreduce(data(R, (count,), dtype), op=op, process_set=process_set)
            check(f"{where} allreduce {op.name} of {count} {np.dtype(dtype)}", got,
                  reduce(data(r, (count,), dtype) for r in ranks).astype(dtype))
    group = hvd.grouped_allreduce([data(R, (900,), np.float64, k) for k in range(4)],
                                  op=hvd.Sum, process_set=process_set)
    for k, got in enumerate(group):
        check(f"{where} grouped_allreduce tensor {k}", got,
              sum(data(r, (900,), np.float64, k) for r in ranks))
    check(f"{where} allgather of uneven rows",
          hvd.allgather(data(R, (300 * me + 7, 3), np.float32), process_set=process_set),
          np.concatenate([data(r, (300 * i + 7, 3), np.float32) for i, r in enumerate(ranks)]))
    check(f"{where} broadcast", hvd.broadcast(data(R, (10_000,), np.float64), ranks[-1],
                                              process_set=process_set),
          data(ranks[-1], (10_000,), np.float64))

    # Rows rank i sends to rank d (of 4 float64, 32 bytes): uneven and over the limit; then
    # small for the first rank (whose calls all fit) and over the limit between the others.
    for label, rows_to in (("uneven splits", lambda i, d: 40 * (i + d + 1)),
                           ("splits over the limit on some ranks only",
                            lambda i, d: 2 if 0 in (i, d) else 100)):
        splits = [[rows_to(i, d) for d in range(n)] for i in range(n)]
        sent = [data(r, (sum(splits[i]), 4), np.float64) for i, r in enumerate(ranks)]
        out, received = hvd.alltoall(sent[me], splits=splits[me], process_set=process_set)
        starts = [sum(splits[i][:me]) for i in range(n)]
        check(f"{where} alltoall with {label}", out,
              np.concatenate([sent[i][starts[i]:starts[i] + splits[i][me]] for i in range(n)]))
        check(f"{where} alltoall received splits with {label}", received,
              np.array([splits[i][me] for i in range(n)], np.int64))
    rows = 500 * n + 1
    check(f"{where} reducescatter",
          hvd.reducescatter(data(R, (rows, 2), np.float32), op=hvd.Sum, process_set=process_set),
          np.array_split(sum(data(r, (rows, 2), np.float32) for r in ranks), n)[me])
    big = {"rank": R, "values": list(range(5000 + R))}
    got = hvd.broadcast_object(big, root_rank=ranks[-1], process_set=process_set)
    if got != {"rank": ranks[-1], "values": list(range(5000 + ranks[-1]))}:
        failures.append(f"{where} broadcast_object gave another object")
    got = hvd.allgather_object(big, process_set=process_set)
    if got != [{"rank": r, "values": list(range(5000 + r))} for r in ranks]:
        failures.append(f"{where} allgather_object gave other objects")


world = runtime.communicator(hvd.global_process_set)
tail = hvd.add_process_set(list(range(1, N)))


def limited(comm):
    """Lower ``comm``'s count limit and wrap its MPI communicator in a Recorder."""
    comm.count_limit = LIMIT
    recorder = Recorder(comm.comm)
    comm.comm = recorder
    return recorder


def check_calls(where, recorder, both_algorithms):
    if recorder.over:
        failures.append(f"{where}: MPI calls over the limit: {sorted(set(recorder.over))}")
    # Both allreduce algorithms ran where there is more than one rank.
    if both_algorithms and not (recorder.calls["Allreduce"] and recorder.calls["Isend"]):
        failures.append(f"{where}: native and ring allreduces did not both run: "
                        f"{dict(recorder.calls)}")


def case_world():
    recorder = limited(world)
    try:
        run_all("world", list(range(N)), hvd.global_process_set)
        hvd.barrier()
    finally:
        world.comm = recorder.comm
    check_calls("world", recorder, True)


def case_process_set():
    if tail.included():
        inner = runtime.communicator(tail)
        recorder = limited(inner)
        try:
            run_all("set", list(range(1, N)), tail)
        finally:
            inner.comm = recorder.comm
        check_calls("set", recorder, False)
    hvd.barrier()


run_cases({"world": case_world, "process_set": case_process_set}, failures, R)
