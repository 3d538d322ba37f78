"""Ranks that disagree must all raise the same MismatchError, then carry on working; each
case reports on its own (case_runner.py)."""

import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases

R, N = hvd.rank(), hvd.size()
last = N - 1
cases = {
    # label: (call, words the message must contain)
    "shape": (lambda: hvd.allreduce(np.zeros(4 if R != last else 5, np.float32), name="w"),
              ["'w'", "shape", f"rank {last}: (5,)", "rank 0: (4,)"]),
    "dtype": (lambda: hvd.allreduce(np.zeros(4, np.float32 if R != last else np.float64), name="g"),
              ["'g'", "dtype", "<f8", "<f4"]),
    "op": (lambda: hvd.allreduce(np.zeros(3), op=hvd.Sum if R else hvd.Max, name="o"),
           ["op", "'MAX'", "'SUM'"]),
    "root": (lambda: hvd.broadcast(np.zeros(3), root_rank=0 if R != last else 1, name="b"),
             ["root_rank", f"rank {last}: 1"]),
    "allgather trailing shape": (lambda: hvd.allgather(np.zeros((2, 3 if R else 4)), name="ag"),
                                 ["'ag'", "shape", "rank 0: (4,)"]),
    "missing tensor": (lambda: hvd.grouped_allreduce([np.zeros(2)] * (2 if R != last else 1), name="grp"),
                       ["number of tensors", f"rank {last}: 1"]),
    "tensor in group": (lambda: hvd.grouped_allreduce([np.zeros(2), np.zeros(3 if R else 2)], name="grp2"),
                        ["tensor 1", "'grp2.1'", "shape"]),
    "name": (lambda: hvd.allreduce(np.zeros(2), name=f"n{R == last}"), ["name", "'nTrue'"]),
}
failures = []


def mismatch(label):
    call, words = cases[label]
    try:
        call()
        failures.append(f"{label}: no error")
    except hvd.MismatchError as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            failures.append(f"{label}: message {str(e)!r} lacks {missing}")
        messages = hvd.allgather_object(str(e))
        if len(set(messages)) != 1:
            failures.append(f"{label}: ranks raised different messages {messages}")


def case_works_after_mismatches():
    """The job still works after every mismatch."""
    if hvd.allreduce(np.ones(3), op=hvd.Sum).tolist() != [N] * 3:
        failures.append("allreduce after mismatches")


def case_bad_arguments():
    """Bad arguments are caught locally, before any rank waits."""
    bad = [(lambda: hvd.allreduce([1, 2]), TypeError, "tensor"),
           (lambda: hvd.allreduce(np.array(["a"])), TypeError, "dtype"),
           (lambda: hvd.allreduce(np.zeros(2), op="mean"), ValueError, "op="),
           (lambda: hvd.broadcast(np.zeros(2), root_rank=N), ValueError, "root_rank"),
           (lambda: hvd.allreduce_(np.zeros((4, 4))[:, 0]), ValueError, "C-contiguous"),
           (lambda: hvd.alltoall(np.zeros(4), splits=[1] * (N + 1)), ValueError, "splits")]
    for call, kind, word in bad:
        try:
            call()
            failures.append(f"no {kind.__name__} for {word}")
        except kind as e:
            if word not in str(e):
                failures.append(f"{kind.__name__} {e!r} does not name {word}")


run_cases({"shape": lambda: mismatch("shape"), "dtype": lambda: mismatch("dtype"),
           "op": lambda: mismatch("op"), "root": lambda: mismatch("root"),
           "allgather_trailing_shape": lambda: mismatch("allgather trailing shape"),
           "missing_tensor": lambda: mismatch("missing tensor"),
           "tensor_in_group": lambda: mismatch("tensor in group"),
           "name": lambda: mismatch("name"),
           "works_after_mismatches": case_works_after_mismatches,
           "bad_arguments": case_bad_arguments}, failures, R)
