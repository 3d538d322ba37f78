"""hvd_trainer.tensorflow's collectives on every rank, eagerly and inside a tf.function,
against NumPy computations of what every rank contributed (each rank can make every rank's
inputs from the seed); float16 scaled sums rounded as Horovod's CPU arithmetic rounds them;
gradients against hand-computed values of Horovod's rules; errors on every rank, then a
working collective.

Each case reports one record per rank (case_runner.py); each case runs whatever the previous
ones did.
"""

import ml_dtypes
import numpy as np
import tensorflow as tf

import hvd_trainer.tensorflow as hvd
from case_runner import run_cases

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


def _rounded_each(t, pre=1.0, post=1.0):
    """Horovod's CPU arithmetic for N equal float16 tensors ``t``: the prescale rounded to
    float16, the sum rounded at each addition, the postscale rounded again."""
    h = (t.astype(np.float32) * np.float32(pre)).astype(np.float16) if pre != 1.0 else t
    total = h
    for _ in range(N - 1):
        total = (total.astype(np.float32) + h.astype(np.float32)).astype(np.float16)
    return (total.astype(np.float32) * np.float32(post)).astype(np.float16)


def float16_scaled_sums_round_as_horovod():
    # Equal non-integer float16 tensors on every rank, as Horovod's TensorFlow tests use:
    # their sum on 3 ranks needs rounding, so rounding it again when scaling (Horovod's
    # arithmetic, what its tests compute) differs from rounding once (the core's rule) in
    # some elements; on 2 ranks the sum is exact and the two agree.
    t = (np.random.RandomState(7).uniform(-100, 100, 257)).astype(np.float16)
    once = (t.astype(np.float32) * N * np.float32(0.7)).astype(np.float16)
    if N == 3:
        assert (once != _rounded_each(t, post=0.7)).any(), "the data tells the rules apart"
    for run in both(lambda x: [hvd.allreduce(x, op=hvd.Average),
                               hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.7),
                               hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.3),
                               hvd.grouped_allreduce([x, x[:3]], op=hvd.Average)[1]]):
        average, post, pre, grouped = [o.numpy() for o in run(tf.constant(t))]
        for got, want, what in [(average, _rounded_each(t, post=1.0 / N), "Average"),
                                (post, _rounded_each(t, post=0.7), "postscale"),
                                (pre, _rounded_each(t, pre=0.3), "prescale"),
                                (grouped, _rounded_each(t[:3], post=1.0 / N), "grouped")]:
            assert got.dtype == np.float16 and np.array_equal(got, want), \
                f"{what}: elements {np.flatnonzero(got != want)[:5]} differ"
    grid = np.stack([t[:5]] * (N + 1))  # N + 1 rows: Horovod's split gives rank 0 two
    counts = [(N + 1) // N + (1 if r < (N + 1) % N else 0) for r in range(N)]
    share = _rounded_each(grid, post=1.0 / N)[sum(counts[:R]):sum(counts[:R + 1])]
    for run in both(lambda x: hvd.reducescatter(x, op=hvd.Average)):
        assert np.array_equal(run(tf.constant(grid)).numpy(), share), "reducescatter Average"


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

    @tf.function
    def different_kinds():  # ranks whose functions differ: an error, not a wait
        return hvd.allreduce(tf.ones([2])) if R == 0 else hvd.allgather(tf.ones([2]))

    try:
        different_kinds()
        raise AssertionError("different collectives in a tf.function did not raise")
    except tf.errors.OpError as e:
        assert "disagree" in str(e), str(e)
    close(hvd.allreduce(tf.ones([3]), op=hvd.Sum), np.full(3, float(N)),
          "the next collective works")


def scalars():
    """0-d tensors (TensorFlow hands their values over as NumPy scalars, not arrays), among
    them a Keras optimizer's step counter in broadcast_variables."""
    import keras
    for function in both(lambda t: hvd.allreduce(t, op=hvd.Sum)):
        close(function(tf.constant(float(R + 1))), float(N * (N + 1) // 2), "scalar allreduce")
    for function in both(lambda t: hvd.broadcast(t, N - 1)):
        got = function(tf.constant(R, tf.int64))
        assert got.shape == () and int(got) == N - 1, got
    close(hvd.allgather(tf.constant([float(R)])), np.arange(N), "one-row allgather")
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    variables = [keras.Variable(data(R, (2,)))]
    optimizer.build(variables)
    optimizer.iterations.assign(R + 5)
    hvd.broadcast_variables(variables + optimizer.variables, root_rank=N - 1)
    assert int(optimizer.iterations.numpy()) == N + 4, optimizer.iterations
    close(variables[0], data(N - 1, (2,)), "broadcast model variable")


def slices_without_dense_shape_and_their_ops():
    """An IndexedSlices without dense_shape (Horovod's suites make them) is reduced like
    one with it; its Average divides as TensorFlow does (integers become floats); ops other
    than Sum and Average on IndexedSlices, Adasum among them, raise NotImplementedError, as
    in Horovod."""
    def run(values):
        return hvd.allreduce(tf.IndexedSlices(values, tf.constant([R, R + 1])), op=hvd.Sum)

    for function in both(run):
        got = function(tf.constant(data(R, (2, 3), seed=2)))
        want = np.zeros((N + 1, 3))
        for r in range(N):
            want[[r, r + 1]] += data(r, (2, 3), seed=2)
        assert sorted(got.indices.numpy().tolist()) == list(range(N + 1)), got.indices
        close(tf.math.unsorted_segment_sum(got.values, got.indices, N + 1), want,
              "IndexedSlices without dense_shape")
    # Average divides as TensorFlow's / does: int32 values come back as float64.
    values = (np.arange(6).reshape(2, 3) + 10 * R).astype(np.int32)
    got = hvd.allreduce(tf.IndexedSlices(tf.constant(values), tf.constant([0, 1])))
    assert got.values.dtype == tf.float64, got.values.dtype
    close(got.values, sum(np.arange(6).reshape(2, 3) + 10 * r for r in range(N)) / N,
          "integer IndexedSlices averaged")
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([R]))
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        for call in (lambda: hvd.allreduce(slices, op=op),
                     lambda: hvd.grouped_allreduce([slices, tf.ones([2])], op=op)):
            try:
                call()
                raise AssertionError(f"op {op} on IndexedSlices did not raise")
            except NotImplementedError:
                pass
    close(hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full(2, float(N)),
          "the next collective works")


def tf1_graph_sessions():
    """In a TF1 graph: broadcast_global_variables gives every global variable the root's
    value (eagerly it raises RuntimeError, as Horovod's does); one session.run of independent
    unnamed collectives, which TensorFlow runs in any order on several threads, here delayed
    so that rank 0 runs them in one order and the others in the other, gets NumPy's results;
    a broadcast's gradient is Horovod's (only ops something depends on run in a graph)."""
    import time
    try:
        hvd.broadcast_global_variables(0)
        raise AssertionError("broadcast_global_variables did not raise eagerly")
    except RuntimeError as e:
        assert "broadcast_variables" in str(e), str(e)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        v = tf.compat.v1.Variable(data(R, (3,)))
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(hvd.broadcast_global_variables(N - 1))
        close(session.run(v), data(N - 1, (3,)), "broadcast_global_variables")

        def delayed(t, seconds):
            return tf.numpy_function(lambda a: (time.sleep(seconds), a)[1], [t], t.dtype)

        first = hvd.allreduce(delayed(tf.constant(data(R, (2,))), 0.0 if R == 0 else 1.0),
                              op=hvd.Sum)
        second = hvd.allgather(delayed(tf.constant(data(R, (1, 4))), 1.0 if R == 0 else 0.0))
        got_first, got_second = session.run([first, second])
        x = tf.ones([3]) * float(R)  # a broadcast's gradient: the allreduce runs on every rank
        gradient = session.run(tf.gradients(hvd.broadcast(x, N - 1), x, tf.ones([3]))[0])
    close(gradient, np.full(3, 1.0 if R == N - 1 else 0.0), "broadcast gradient in a graph")
    close(got_first, sum(data(r, (2,)) for r in range(N)), "first, in any order")
    close(got_second, np.concatenate([data(r, (1, 4)) for r in range(N)]),
          "second, in any order")


def a_rank_that_leaves_a_graph_early():
    """Rank 0 leaves a TF1 graph after its first step (as a test whose check failed there
    alone does) and makes an eager collective, while the others run the graph's next step:
    every rank raises a mismatch instead of waiting, and the next collective works."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        ops = [hvd.allreduce(tf.constant([1.0, float(step)]), op=hvd.Sum) for step in range(2)]
        close(session.run(ops[0]), [N, 0.0], "the graph's first step")
        if R != 0:
            try:
                session.run(ops[1])
                raise AssertionError("a graph op that rank 0 never runs did not raise")
            except tf.errors.OpError as e:
                assert "disagree" in str(e), str(e)
    if R == 0:
        try:
            hvd.allreduce(tf.ones([2]), op=hvd.Sum)
            raise AssertionError("an eager call the others make in a graph did not raise")
        except tf.errors.FailedPreconditionError as e:
            assert isinstance(e, hvd.MismatchError) and "disagree" in str(e), str(e)
    close(hvd.allreduce(tf.ones([3]), op=hvd.Sum), np.full(3, float(N)),
          "the next collective works")


def runtime_ops():
    assert int(hvd.rank_op()) == R and int(hvd.size_op()) == N
    assert int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.process_set_included_op()) == 1


run_cases({"allreduce_ops_dtypes": allreduce_ops_dtypes,
           "variables_names_process_sets": variables_names_process_sets,
           "grouped_allreduce_with_slices": grouped_allreduce_with_slices,
           "allgather_variable_rows": allgather_variable_rows,
           "broadcasts": broadcasts,
           "alltoall_splits": alltoall_splits,
           "reducescatters": reducescatters,
           "float16_scaled_sums_round_as_horovod": float16_scaled_sums_round_as_horovod,
           "gradients": gradients,
           "compression": compression,
           "errors_on_every_rank": errors_on_every_rank,
           "scalars": scalars,
           "slices_without_dense_shape_and_their_ops": slices_without_dense_shape_and_their_ops,
           "tf1_graph_sessions": tf1_graph_sessions,
           "a_rank_that_leaves_a_graph_early": a_rank_that_leaves_a_graph_early,
           "runtime_ops": runtime_ops}, rank=R)
