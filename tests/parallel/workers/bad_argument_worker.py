"""One rank passes a bad argument to a NumPy collective; every rank must raise the same error.

For each case the bad rank (rank 0 or the last rank, alternately) calls the collective with one
bad argument while the others call it correctly. Every rank must raise the case's exception
type with the same message, which names the bad rank; then every rank calls the collective
correctly and the result must equal a NumPy reference computed from all ranks' inputs.
Last, two ranks pass different bad arguments. Run as: worker.py [label ...] (default: all);
each label is a case of its own (case_runner.py).
"""
import functools
import threading

import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases
# gather_object, scatter_object: internal, behind checkpoints
from hvd_trainer.collectives import objects

R, N = hvd.rank(), hvd.size()


def vec(r):
    return np.arange(6, dtype=np.float64) * (r + 1)


def mat(r):
    """2N rows: alltoall splits it equally."""
    return np.arange(2 * N * 3, dtype=np.float32).reshape(2 * N, 3) + 10 * r


def odd(r):
    """2N + 1 rows: reducescatter gives the first rank one row more."""
    return np.arange((2 * N + 1) * 2, dtype=np.float64).reshape(2 * N + 1, 2) * (r + 1)


def total(make):
    return sum(make(r) for r in range(N))


def strided():
    return np.zeros((6, 2))[:, 0]


def read_only(r):
    a = vec(r)
    a.flags.writeable = False
    return a


def obj(r):
    return {"rank": r, "items": list(range(r + 3))}


# label: (collective, good keyword arguments for rank r, the bad rank's overrides,
#         expected exception, words its message must hold, reference result on this rank)
CASES = {
    "allreduce list": (hvd.allreduce, lambda r: dict(tensor=vec(r), op=hvd.Sum),
                       lambda: dict(tensor=[1, 2, 3]), TypeError, ["numpy.ndarray"],
                       lambda: total(vec)),
    "allreduce dtype": (hvd.allreduce, lambda r: dict(tensor=vec(r), op=hvd.Sum),
                        lambda: dict(tensor=np.array(["a"] * 6)), TypeError, ["dtype"],
                        lambda: total(vec)),
    "allreduce op": (hvd.allreduce, lambda r: dict(tensor=vec(r), op=hvd.Sum, name="op"),
                     lambda: dict(op="mean"), ValueError, ["op='mean'", "'op'"],
                     lambda: total(vec)),
    "allreduce prescale": (hvd.allreduce, lambda r: dict(tensor=vec(r), op=hvd.Sum),
                           lambda: dict(prescale_factor="2"), TypeError, ["prescale_factor"],
                           lambda: total(vec)),
    "allreduce postscale": (hvd.allreduce, lambda r: dict(tensor=vec(r), op=hvd.Sum,
                                                          postscale_factor=0.5),
                            lambda: dict(postscale_factor=None), TypeError,
                            ["postscale_factor"], lambda: total(vec) * 0.5),
    "allreduce name": (hvd.allreduce, lambda r: dict(tensor=vec(r), op=hvd.Sum, name="n"),
                       lambda: dict(name=threading.Lock()), TypeError,
                       ["must be a string"], lambda: total(vec)),
    "allreduce_ strided": (hvd.allreduce_, lambda r: dict(tensor=vec(r), op=hvd.Sum),
                           lambda: dict(tensor=strided()), ValueError, ["C-contiguous"],
                           lambda: total(vec)),
    "allreduce_ read-only": (hvd.allreduce_, lambda r: dict(tensor=vec(r), op=hvd.Max),
                             lambda: dict(tensor=read_only(R)), ValueError, ["writeable"],
                             lambda: vec(N - 1)),
    "grouped_allreduce array": (hvd.grouped_allreduce,
                                lambda r: dict(tensors=[vec(r), mat(r)], op=hvd.Sum),
                                lambda: dict(tensors=vec(R)), TypeError, ["list"],
                                lambda: [total(vec), total(mat)]),
    "grouped_allreduce element": (hvd.grouped_allreduce,
                                  lambda r: dict(tensors=[vec(r), mat(r)], op=hvd.Sum),
                                  lambda: dict(tensors=[vec(R), "x"]), TypeError,
                                  ["tensors[1]"], lambda: [total(vec), total(mat)]),
    "grouped_allreduce op": (hvd.grouped_allreduce,
                             lambda r: dict(tensors=[vec(r), mat(r)], op=hvd.Sum),
                             lambda: dict(op=7), ValueError, ["op=7"],
                             lambda: [total(vec), total(mat)]),
    "grouped_allreduce_ strided": (hvd.grouped_allreduce_,
                                   lambda r: dict(tensors=[vec(r), mat(r)], op=hvd.Sum),
                                   lambda: dict(tensors=[vec(R), mat(R)[:, :2]]), ValueError,
                                   ["tensors[1]", "C-contiguous"],
                                   lambda: [total(vec), total(mat)]),
    "allgather 0-d": (hvd.allgather, lambda r: dict(tensor=mat(r)[:r + 1]),
                      lambda: dict(tensor=np.array(3.0, np.float32)), ValueError,
                      ["at least one dimension"],
                      lambda: np.concatenate([mat(r)[:r + 1] for r in range(N)])),
    "allgather tuple": (hvd.allgather, lambda r: dict(tensor=mat(r)[:r + 1]),
                        lambda: dict(tensor=(1.0, 2.0)), TypeError, ["numpy.ndarray"],
                        lambda: np.concatenate([mat(r)[:r + 1] for r in range(N)])),
    "grouped_allgather 0-d": (hvd.grouped_allgather,
                              lambda r: dict(tensors=[vec(r), mat(r)[:r + 1]]),
                              lambda: dict(tensors=[vec(R), np.array(1.0, np.float32)]),
                              ValueError, ["tensors[1]"],
                              lambda: [np.concatenate([vec(r) for r in range(N)]),
                                       np.concatenate([mat(r)[:r + 1] for r in range(N)])]),
    "grouped_allgather array": (hvd.grouped_allgather,
                                lambda r: dict(tensors=[vec(r), mat(r)[:r + 1]]),
                                lambda: dict(tensors=vec(R)), TypeError, ["list"],
                                lambda: [np.concatenate([vec(r) for r in range(N)]),
                                         np.concatenate([mat(r)[:r + 1] for r in range(N)])]),
    "broadcast root past the end": (hvd.broadcast, lambda r: dict(tensor=vec(r), root_rank=0),
                                    lambda: dict(root_rank=N), ValueError,
                                    [f"root_rank={N}"], lambda: vec(0)),
    "broadcast negative root": (hvd.broadcast, lambda r: dict(tensor=vec(r), root_rank=N - 1),
                                lambda: dict(root_rank=-1), ValueError, ["root_rank=-1"],
                                lambda: vec(N - 1)),
    "broadcast root text": (hvd.broadcast, lambda r: dict(tensor=vec(r), root_rank=0),
                            lambda: dict(root_rank="0"), ValueError, ["root_rank='0'"],
                            lambda: vec(0)),
    "broadcast object dtype": (hvd.broadcast, lambda r: dict(tensor=vec(r), root_rank=0),
                               lambda: dict(tensor=np.array([None] * 6)), TypeError,
                               ["dtype"], lambda: vec(0)),
    "broadcast_ strided": (hvd.broadcast_, lambda r: dict(tensor=vec(r), root_rank=0),
                           lambda: dict(tensor=strided()), ValueError, ["C-contiguous"],
                           lambda: vec(0)),
    "alltoall indivisible": (hvd.alltoall, lambda r: dict(tensor=mat(r)),
                             lambda: dict(tensor=mat(R)[:-1]), ValueError, ["divisible"],
                             lambda: np.concatenate([mat(r)[2 * R:2 * R + 2]
                                                     for r in range(N)])),
    "alltoall 0-d": (hvd.alltoall, lambda r: dict(tensor=mat(r)),
                     lambda: dict(tensor=np.array(1.0, np.float32)), ValueError,
                     ["at least one dimension"],
                     lambda: np.concatenate([mat(r)[2 * R:2 * R + 2] for r in range(N)])),
    "alltoall splits sum": (hvd.alltoall, lambda r: dict(tensor=mat(r)),
                            lambda: dict(splits=[1] * N), ValueError, ["splits="],
                            lambda: np.concatenate([mat(r)[2 * R:2 * R + 2]
                                                    for r in range(N)])),
    "alltoall float splits": (hvd.alltoall, lambda r: dict(tensor=mat(r)),
                              lambda: dict(splits=[2.0] * N), TypeError, ["integers"],
                              lambda: np.concatenate([mat(r)[2 * R:2 * R + 2]
                                                      for r in range(N)])),
    "reducescatter 0-d": (hvd.reducescatter, lambda r: dict(tensor=odd(r), op=hvd.Sum),
                          lambda: dict(tensor=np.array(2.0)), ValueError,
                          ["at least one dimension"],
                          lambda: np.array_split(total(odd), N)[R]),
    "reducescatter op": (hvd.reducescatter, lambda r: dict(tensor=odd(r), op=hvd.Sum),
                         lambda: dict(op="sum"), ValueError, ["op='sum'"],
                         lambda: np.array_split(total(odd), N)[R]),
    "reducescatter postscale": (hvd.reducescatter, lambda r: dict(tensor=odd(r), op=hvd.Sum),
                                lambda: dict(postscale_factor="x"), TypeError,
                                ["postscale_factor"], lambda: np.array_split(total(odd), N)[R]),
    "grouped_reducescatter array": (hvd.grouped_reducescatter,
                                    lambda r: dict(tensors=[odd(r), vec(r)], op=hvd.Sum),
                                    lambda: dict(tensors=odd(R)), TypeError, ["list"],
                                    lambda: [np.array_split(total(odd), N)[R],
                                             np.array_split(total(vec), N)[R]]),
    "grouped_reducescatter 0-d": (hvd.grouped_reducescatter,
                                  lambda r: dict(tensors=[odd(r), vec(r)], op=hvd.Sum),
                                  lambda: dict(tensors=[odd(R), np.array(1.0)]), ValueError,
                                  ["tensors[1]"],
                                  lambda: [np.array_split(total(odd), N)[R],
                                           np.array_split(total(vec), N)[R]]),
    "broadcast_object root": (hvd.broadcast_object, lambda r: dict(obj=obj(r), root_rank=0),
                              lambda: dict(root_rank=N + 1), ValueError,
                              [f"root_rank={N + 1}"], lambda: obj(0)),
    "broadcast_object unpicklable": (hvd.broadcast_object,
                                     lambda r: dict(obj=obj(r), root_rank=0),
                                     lambda: dict(obj=threading.Lock()), TypeError, ["pickle"],
                                     lambda: obj(0)),
    "allgather_object name": (hvd.allgather_object, lambda r: dict(obj=obj(r), name="o"),
                              lambda: dict(name=7), TypeError, ["name=7"],
                              lambda: [obj(r) for r in range(N)]),
    "allgather_object unpicklable": (hvd.allgather_object, lambda r: dict(obj=obj(r)),
                                     lambda: dict(obj=threading.Lock()), TypeError, ["pickle"],
                                     lambda: [obj(r) for r in range(N)]),
    # Pickled after the agreement, these failed on the unpicklable rank alone: the others went
    # on into the data phase.
    "gather_object unpicklable": (objects.gather_object, lambda r: dict(obj=obj(r), root_rank=0),
                                  lambda: dict(obj=threading.Lock()), TypeError, ["pickle"],
                                  lambda: [obj(r) for r in range(N)] if R == 0 else None),
    "scatter_object unpicklable": (objects.scatter_object,
                                   lambda r: dict(objs=[obj(q) for q in range(N)], root_rank=0),
                                   lambda: dict(objs=[obj(0)] * (N - 1) + [threading.Lock()]),
                                   TypeError, ["pickle", f"objs[{N - 1}]"], lambda: obj(R)),
}
# Cases whose bad argument only matters on the root (rank 0); the others alternate.
ROOT_ONLY = {"broadcast_object unpicklable", "scatter_object unpicklable"}


def same(got, want):
    if isinstance(want, list) and want and isinstance(want[0], np.ndarray):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    if isinstance(want, np.ndarray):
        return (isinstance(got, np.ndarray) and got.dtype == want.dtype
                and got.shape == want.shape and np.array_equal(got, want))
    return got == want


failures = []


def bad_argument(label):
    fn, good, bad_args, kind, words, want = CASES[label]
    bad = 0 if label in ROOT_ONLY or list(CASES).index(label) % 2 == 0 else N - 1
    args = dict(good(R), **(bad_args() if R == bad else {}))
    first = args.pop(next(iter(args)))  # the tensor (or object) goes by position, as usual
    try:
        fn(first, **args)
        message = None
        failures.append(f"{label}: rank {R} raised nothing")
    except Exception as e:  # noqa: BLE001 - the type is checked just below
        message = f"{type(e).__name__}: {e}"
        if type(e) is not kind:
            failures.append(f"{label}: rank {R} raised {message}, not {kind.__name__}")
        missing = [w for w in [f"on rank {bad}"] + words if w not in str(e)]
        if missing:
            failures.append(f"{label}: {message!r} lacks {missing}")
    # The next collective works and gives NumPy's result.
    args = good(R)
    got = fn(args.pop(next(iter(args))), **args)
    if not same(got, want()):
        failures.append(f"{label}: the next call gave {got!r}, want {want()!r}")
    messages = hvd.allgather_object(message)
    if len(set(messages)) != 1:
        failures.append(f"{label}: ranks raised different errors {messages}")


def two_bad_ranks():
    """Two ranks with different bad arguments: every rank raises the lowest rank's error."""
    try:
        hvd.allreduce([1.0] if R == N - 1 else vec(R), op="mean" if R == 0 else hvd.Sum)
        failures.append(f"two bad ranks: rank {R} raised nothing")
    except ValueError as e:
        if "on rank 0: op='mean'" not in str(e):
            failures.append(f"two bad ranks: {e!r} does not name rank 0's error")
    except Exception as e:  # noqa: BLE001 - any other error is a failure
        failures.append(f"two bad ranks: rank {R} raised {e!r}, not rank 0's ValueError")
    if not np.array_equal(hvd.allreduce(vec(R), op=hvd.Sum), total(vec)):
        failures.append("two bad ranks: the next allreduce differs from NumPy")


run_cases({**{label: functools.partial(bad_argument, label) for label in CASES},
           "two bad ranks": two_bad_ranks}, failures, R)
