"""hvd_trainer.tensorflow's collectives on every rank, eagerly and inside a tf.function,
against NumPy computations of what every rank contributed (each rank can make every rank's
inputs from the seed); gradients against hand-computed values of Horovod's rules; errors on
every rank, then a working collective.

Prints "tf ops ok: <case>" for each case that passed on this rank, "tf ops FAILED: <case>:
<why>" otherwise; each case runs whatever the previous ones did.
"""
import sys
import traceback

import ml_dtypes
import numpy as np
import tensorflow as tf

import hvd_trainer.tensorflow as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()


def data(rank, shape, dtype=np.float32, seed=0):
    rng = np.random.RandomState(100 * seed + rank)
    return (rng.uniform(-10, 10, shape)).astype(dtype)


def close(got, want, what, tol=1e-5):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol), \
        f"{what}: {got} != {want}"


def both(function):
    """``function`` run eagerly and inside a tf.function (the same results expected)."""
    return [function, tf.function(function)]


def allreduce_ops_dtypes():
    ops = {hvd.Sum: np.sum, hvd.Min: np.min, hvd.Max: np.max, hvd.Product: np.prod}
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16):
        every = np.stack([data(r, (3, 4), dtype) for r in range(N)])
        for op, reduce in ops.items():
            for run in both(lambda t, op=op: hvd.allreduce(t, op=op)):
                close(run(tf.constant(every[R])), reduce(every, axis=0), f"{dtype} {op}",
                      tol=1e-2 if dtype == np.float16 else 1e-5)
        if np.dtype(dtype).kind == "f":
            for run in both(lambda t: hvd.allreduce(t, prescale_factor=0.5,
                                                    postscale_factor=3.0)):
                close(run(tf.constant(every[R])), every.sum(0) * 0.5 * 3.0 / N,
                      f"{dtype} average with scales", tol=1e-2 if dtype == np.float16 else 1e-5)
    bf16 = np.stack([data(r, (5,)) for r in range(N)]).astype(ml_dtypes.bfloat16)
    got = hvd.allreduce(tf.constant(bf16[R]), op=hvd.Sum)
    assert got.dtype == tf.bfloat16
    close(got.numpy().astype(np.float32), bf16.astype(np.float32).sum(0), "bfloat16", tol=0.2)


def variables_names_process_sets():
    v = tf.Variable(data(R, (4,)))
    close(hvd.allreduce(v, name="named.v", op=hvd.Sum), sum(data(r, (4,)) for r in range(N)),
          "variable")
    members = list(range(1, N))  # every rank but 0
    others = hvd.add_process_set(members)
    if others.included():
        for run in both(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=others)):
            close(run(tf.constant(data(R, (2,)))), sum(data(r, (2,)) for r in members),
                  "process set")
        close(hvd.broadcast(tf.constant(data(R, (2,))), N - 1, process_set=others),
              data(N - 1, (2,)), f"broadcast in a set from global rank {N - 1}")
    hvd.remove_process_set(others)


def grouped_allreduce_with_slices():
    def run(a, b, values):
        slices = tf.IndexedSlices(values, tf.constant([R, R + 1]), tf.constant([N + 1, 2]))
        return hvd.grouped_allreduce([a, b, slices], op=hvd.Sum)

    for function in both(run):
        a, b, s = function(tf.constant(data(R, (3,))), tf.constant(data(R, (2, 2), np.float64)),
                           tf.constant(data(R, (2, 2), seed=1)))
        close(a, sum(data(r, (3,)) for r in range(N)), "grouped a")
        close(b, sum(data(r, (2, 2), np.float64) for r in range(N)), "grouped b")
        assert isinstance(s, tf.IndexedSlices)
        want = np.zeros((N + 1, 2))
        for r in range(N):
            want[[r, r + 1]] += data(r, (2, 2), seed=1)
        close(tf.convert_to_tensor(s), want, "grouped IndexedSlices")
        assert sorted(s.indices.numpy().tolist()) == list(range(N + 1)), "indices once each"


def allgather_variable_rows():
    for function in both(lambda t: hvd.allgather(t)):
        got = function(tf.constant(data(R, (R + 1, 3))))
        close(got, np.concatenate([data(r, (r + 1, 3)) for r in range(N)]), "allgather")
    a, b = hvd.grouped_allgather([tf.constant(data(R, (R + 1,))),
                                  tf.constant(data(R, (2, 2), np.int32))])
    close(a, np.concatenate([data(r, (r + 1,)) for r in range(N)]), "grouped allgather a")
    close(b, np.concatenate([data(r, (2, 2), np.int32) for r in range(N)]), "grouped b")


def broadcasts():
    for root in range(N):
        for function in both(lambda t, root=root: hvd.broadcast(t, root)):
            close(function(tf.constant(data(R, (2, 3)))), data(root, (2, 3)), f"root {root}")
    v = [tf.Variable(data(R, (3,))), tf.Variable(data(R, (2,), np.int64))]
    hvd.broadcast_variables(v, root_rank=N - 1)
    close(v[0], data(N - 1, (3,)), "broadcast_variables 0")
    close(v[1], data(N - 1, (2,), np.int64), "broadcast_variables 1")
    w = tf.Variable(data(R, (2,)))
    returned, = hvd.broadcast_([w], 0)
    close(w, data(0, (2,)), "broadcast_ in place")
    close(returned, data(0, (2,)), "broadcast_ result")
    assert hvd.broadcast_object({"rank": R, "x": [1, 2]}, root_rank=N - 1) == \
        {"rank": N - 1, "x": [1, 2]}
    assert hvd.allgather_object(("r", R)) == [("r", r) for r in range(N)]
    send = hvd.broadcast_object_fn(root_rank=0)
    assert send(R * 7) == 0


def alltoall_splits():
    def sends(r):  # rows rank r sends to each rank (some none)
        return [(r + d) % 3 for d in range(N)]

    def tensor(r):
        return data(r, (sum(sends(r)), 2))

    for function in both(lambda t, s: hvd.alltoall(t, splits=s)):
        out, received = function(tf.constant(tensor(R)), tf.constant(sends(R)))
        want = []
        for r in range(N):
            start = sum(sends(r)[:R])
            want.append(tensor(r)[start:start + sends(r)[R]])
        close(out, np.concatenate(want), "alltoall")
        assert received.numpy().tolist() == [sends(r)[R] for r in range(N)]
        assert received.dtype == tf.int32
    equal = hvd.alltoall(tf.constant(data(R, (2 * N,))))
    close(equal, np.concatenate([data(r, (2 * N,))[2 * R:2 * R + 2] for r in range(N)]),
          "alltoall equal splits")


def reducescatters():
    every = [data(r, (2 * N + 1, 2)) for r in range(N)]
    total = sum(every)
    counts = [(2 * N + 1) // N + (1 if r < (2 * N + 1) % N else 0) for r in range(N)]
    start = sum(counts[:R])
    for function in both(lambda t: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0)):
        close(function(tf.constant(every[R])), 2.0 * total[start:start + counts[R]],
              "reducescatter")
    a, b = hvd.grouped_reducescatter([tf.constant(every[R]), tf.constant(every[R] * 2)])
    close(a, total[start:start + counts[R]] / N, "grouped reducescatter average")
    close(b, 2 * total[start:start + counts[R]] / N, "grouped reducescatter b")


def gradients():
    x = tf.Variable(data(R, (2 * N, 3)))
    weights = tf.constant(data(7, (2 * N, 3)))  # the same on every rank
    with tf.GradientTape(persistent=True) as tape:
        reduced = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0)
        gathered = hvd.allgather(x)
        broadcast = hvd.broadcast(x, 0)
        scattered = hvd.reducescatter(x, op=hvd.Sum)
        exchanged = hvd.alltoall(x)
        losses = [tf.reduce_sum(reduced * weights), tf.reduce_sum(gathered[:2 * N] * 3.0),
                  tf.reduce_sum(broadcast * weights), tf.reduce_sum(scattered * 5.0),
                  tf.reduce_sum(exchanged * float(R + 1))]
    # allreduce: the gradient allreduced with the same op and scales
    close(tape.gradient(losses[0], x), weights.numpy() * 2.0 * N, "allreduce gradient")
    # allgather: gradient averaged, own rows taken back (rank 0's rows alone are in the loss)
    close(tape.gradient(losses[1], x), np.full((2 * N, 3), 3.0 if R == 0 else 0.0),
          "allgather gradient")
    # broadcast: averaged into the root, zeros elsewhere
    close(tape.gradient(losses[2], x), weights.numpy() if R == 0 else np.zeros((2 * N, 3)),
          "broadcast gradient")
    # reducescatter with Sum: Horovod's rule, the gathered gradients times the set's size
    close(tape.gradient(losses[3], x), np.full((2 * N, 3), 5.0 * N), "reducescatter gradient")
    # alltoall: rows go back where they came from; block d went to rank d
    want = np.concatenate([np.full((2, 3), float(d + 1)) for d in range(N)])
    close(tape.gradient(losses[4], x), want, "alltoall gradient")

    @tf.function
    def in_function(t):
        with tf.GradientTape() as inner:
            inner.watch(t)
            loss = tf.reduce_sum(hvd.allreduce(t, op=hvd.Average) * weights)
        return inner.gradient(loss, t)

    close(in_function(tf.constant(data(R, (2 * N, 3)))), weights.numpy(),
          "allreduce gradient in a tf.function")


def compression():
    every = np.stack([data(r, (6,)) for r in range(N)])
    got = hvd.allreduce(tf.constant(every[R]), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert got.dtype == tf.float32
    close(got, every.astype(np.float16).astype(np.float32).sum(0), "fp16", tol=0.05)


def errors_on_every_rank():
    try:
        hvd.allreduce(tf.ones([R + 1]), name="differs")
        raise AssertionError("a shape mismatch did not raise")
    except tf.errors.FailedPreconditionError as e:
        assert isinstance(e, hvd.MismatchError) and "differs" in str(e), str(e)
    try:
        hvd.alltoall(tf.ones([N + 1]))
        raise AssertionError("unequal splits did not raise")
    except tf.errors.InvalidArgumentError as e:
        assert isinstance(e, ValueError), type(e)
    try:  # only rank 0's argument is bad; every rank raises
        hvd.allreduce(tf.constant(["text"]) if R == 0 else tf.ones([1]), name="bad")
        raise AssertionError("a string tensor did not raise")
    except tf.errors.InvalidArgumentError as e:
        assert "rank 0" in str(e) or R == 0, str(e)

    @tf.function
    def mismatched():
        return hvd.allreduce(tf.ones([R + 2]))

    try:
        mismatched()
        raise AssertionError("a mismatch in a tf.function did not raise")
    except tf.errors.OpError as e:
        assert "disagree" in str(e), str(e)
    close(hvd.allreduce(tf.ones([3]), op=hvd.Sum), np.full(3, float(N)),
          "the next collective works")


def runtime_ops():
    assert int(hvd.rank_op()) == R and int(hvd.size_op()) == N
    assert int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.process_set_included_op()) == 1


CASES = [allreduce_ops_dtypes, variables_names_process_sets, grouped_allreduce_with_slices,
         allgather_variable_rows, broadcasts, alltoall_splits, reducescatters, gradients,
         compression, errors_on_every_rank, runtime_ops]

for case in CASES:
    try:
        case()
        print(f"tf ops ok: {case.__name__}", flush=True)
    except Exception:  # reported per case; the job goes on with the next case
        why = traceback.format_exc().strip().replace("\n", " | ")  # one line per failure
        print(f"tf ops FAILED: {case.__name__}: {why}", flush=True)
sys.stdout.flush()
