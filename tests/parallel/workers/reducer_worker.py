"""The reducer on plain NumPy gradients across ranks, checked against NumPy sums of what every
rank contributed (each rank can compute every rank's inputs from the seed).

Cases: eager readiness in a different order on every rank, from threads; step-time readiness
with stale and fresh-nowhere gradients; predivision; row-sparse gradients; fp16 and 2-bit
compression (2-bit against MXNet's rule by hand); an agreement mismatch raised on every rank,
then a working step; residual state gathered to the first rank only and scattered back.
Each case reports on its own (case_runner.py).
"""
import random
import threading

import numpy as np

import hvd_trainer
from case_runner import run_cases
from hvd_trainer.coordination import agreement, messages
from hvd_trainer.collectives import objects
from hvd_trainer.runtime import runtime
from hvd_trainer.compression import Compression, TwoBit
from hvd_trainer.training.buckets import Gradient
from hvd_trainer.training.reducer import Reducer

hvd_trainer.init()
R, N = hvd_trainer.rank(), hvd_trainer.size()
SHAPES = [(5,), (3, 4), (7,), (2, 2), (6,)]


def values(rank, key, shape, step=0):
    rng = np.random.RandomState(1000 * step + 10 * rank + key)
    return rng.uniform(-1, 1, shape).astype(np.float32)


def make(**settings):
    reducer = Reducer(**settings)
    reducer.bucket_threshold = 48  # a few small buckets
    return reducer


def back(reducer):
    views = {}
    for bucket in reducer.buckets:
        flat = np.zeros(bucket.bounds[-1], bucket.dtype)
        for key, a, b in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
            views[key] = flat[a:b].reshape(reducer.gradients[key].shape)
        bucket.open = lambda flat=flat: flat
    return views


def close(got, want, what, tol=1e-6):
    assert np.allclose(got, want, atol=tol), f"rank {R} {what}: {got} != {want}"


def eager_any_order():
    reducer = make(eager=True, gradient_predivide_factor=2.0)
    reducer.set_gradients([Gradient(k, s, "<f4") for k, s in enumerate(SHAPES)]
                          + [Gradient(8, (), "<f4"),  # 0-d: a per-tensor one
                             Gradient(9, (6, 2), "<f4", sparse=True)])
    views = back(reducer)
    assert len(reducer.buckets) > 2
    given = {8: np.array(values(R, 8, ())), 9: (np.array([R, 5]), values(R, 9, (2, 2)))}
    order = list(range(len(SHAPES))) + [8, 9]
    random.Random(R).shuffle(order)  # every rank in its own order
    for key in order:
        if key in views:
            views[key][...] = values(R, key, SHAPES[key])
        t = threading.Thread(target=reducer.mark_ready, args=(key, given.get(key)))
        t.start()
        t.join()
    step = reducer.launch()
    results = reducer.finish(step)
    assert all(h.poll() for h in step.handles)
    assert reducer.ready_order == order
    for key, shape in enumerate(SHAPES):
        close(views[key], sum(values(r, key, shape) for r in range(N)) / 2.0, f"eager {key}")
    close(results[8], sum(values(r, 8, ()) for r in range(N)) / 2.0, "eager per-tensor")
    table = np.zeros((6, 2), np.float32)
    for r in range(N):
        table[[r, 5]] += values(r, 9, (2, 2))
    ids, rows = results[9]
    assert ids.tolist() == sorted(set(range(N)) | {5}), ids
    close(rows, table[ids] / 2.0, "eager sparse")


def step_time_stale():
    reducer = make()
    gradients = [Gradient(k, s, "<f4") for k, s in enumerate(SHAPES)]
    gradients.append(Gradient(9, (), "<f4"))  # 0-d: a per-tensor one
    reducer.set_gradients(gradients)
    views = back(reducer)
    for key, shape in enumerate(SHAPES):
        views[key][...] = values(R, key, shape)
    stale_on_last = {1, 9}  # fresh on every rank but the last
    fresh_nowhere = 3
    for key in list(range(len(SHAPES))) + [9]:
        if key == fresh_nowhere or (R == N - 1 and key in stale_on_last):
            continue
        value = np.array(values(R, key, ())) if key == 9 else None
        reducer.mark_ready(key, value)
    step = reducer.launch()
    results = reducer.finish(step)
    assert not reducer.fresh(step, fresh_nowhere)
    close(views[fresh_nowhere], values(R, fresh_nowhere, SHAPES[fresh_nowhere]), "untouched")
    for key, shape in enumerate(SHAPES):
        if key == fresh_nowhere:
            continue
        ranks = range(N - 1) if key in stale_on_last else range(N)
        close(views[key], sum(values(r, key, shape) for r in ranks), f"stale {key}")
    close(results[9], sum(values(r, 9, ()) for r in range(N - 1)), "per-tensor stale")


def sparse_rows():
    reducer = make(gradient_predivide_factor=4.0)
    reducer.set_gradients([Gradient(0, (10, 3), "<f4", sparse=True)])
    want = np.zeros((10, 3), np.float32)
    for r in range(N):
        ids = np.array([r, r + 2, 9])
        want[ids] += values(r, 0, (3, 3))
    reducer.mark_ready(0, (np.array([R, R + 2, 9]), values(R, 0, (3, 3))))
    ids, rows = reducer.finish(reducer.launch())[0]
    assert ids.tolist() == sorted({i for r in range(N) for i in (r, r + 2, 9)})
    close(rows, want[ids] / 4.0, "sparse rows")


def two_bit_by_hand(grads, threshold):
    """MXNet's 2-bit rule on one rank's gradients over steps: what it sends, its residual."""
    residual, sent = np.zeros_like(grads[0]), []
    for g in grads:
        residual = residual + g
        out = np.where(residual >= threshold, threshold,
                       np.where(residual <= -threshold, -threshold, 0)).astype(np.float32)
        residual = residual - out
        sent.append(out)
    return sent, residual


def compression():
    fp16 = make(compression=Compression.fp16)
    fp16.set_gradients([Gradient(0, (6,), "<f4")])
    fp16.mark_ready(0, values(R, 0, (6,)))
    got = fp16.finish(fp16.launch())[0]
    want = sum(values(r, 0, (6,)).astype(np.float16).astype(np.float32) for r in range(N))
    close(got, want, "fp16", tol=1e-2)
    assert got.dtype == np.float32 and fp16.stats.bytes_sent > 0
    codec = TwoBit(0.3)
    codec.min_size = 1
    two = make(compression=codec)
    two.set_gradients([Gradient(0, (40,), "<f4")])
    steps = 3
    for s in range(steps):
        two.mark_ready(0, values(R, 0, (40,), s))
        got = two.finish(two.launch())[0]
        want = sum(two_bit_by_hand([values(r, 0, (40,), t) for t in range(s + 1)],
                                   np.float32(0.3))[0][-1] for r in range(N))
        assert np.array_equal(got, want), f"rank {R} 2-bit step {s}"
    # Residuals gathered to the first rank alone, then scattered back to a new reducer.
    state = two.gather_state("residuals")
    residuals = [two_bit_by_hand([values(r, 0, (40,), t) for t in range(steps)],
                                 np.float32(0.3))[1] for r in range(N)]
    if R == 0:
        assert state["size"] == N and len(state["residuals"]) == N
        for r in range(N):
            close(state["residuals"][r][0], residuals[r], f"gathered residual of rank {r}")
    else:
        assert state is None
    fresh = make(compression=codec)
    fresh.scatter_state(state if R == 0 else None, "residuals")
    close(fresh.feedback.residuals[0], residuals[R], "scattered residual")


def mismatch_then_work(eager):
    reducer = make(eager=eager)
    shape = (4,) if R == 0 else (5,)
    reducer.set_gradients([Gradient(0, shape, "<f4")])
    back(reducer)
    reducer.mark_ready(0)
    step = reducer.launch()
    try:
        reducer.finish(step)
    except messages.MismatchError as e:
        assert "ranks disagree on shape of tensor 0 'grad.0'" in str(e), e
    else:
        raise AssertionError(f"rank {R}: no MismatchError (eager={eager})")
    try:  # the bucket's handle raises it too
        step.handles[0].wait()
    except messages.MismatchError:
        pass
    else:
        raise AssertionError(f"rank {R}: the handle did not raise (eager={eager})")
    reducer.set_gradients([Gradient(0, (4,), "<f4")])
    views = back(reducer)
    views[0][...] = R + 1
    reducer.mark_ready(0)
    reducer.finish(reducer.launch())
    close(views[0], np.full(4, N * (N + 1) / 2), "after mismatch")


def one_agreement_per_step(eager):
    reducer = make(eager=eager)
    reducer.set_gradients([Gradient(k, s, "<f4") for k, s in enumerate(SHAPES)]
                          + [Gradient(9, (), "<f4")])
    back(reducer)
    comm = runtime.communicator(hvd_trainer.global_process_set)
    before = agreement.agreements(comm)
    for _ in range(3):
        for key in list(range(len(SHAPES))) + [9]:
            reducer.mark_ready(key, np.ones((), np.float32) if key == 9 else None)
        reducer.finish(reducer.launch())
    assert agreement.agreements(comm) - before == 3, f"eager={eager}"



def gather_and_scatter_objects():
    got = objects.gather_object(("rank", R), root_rank=N - 1)
    assert got == ([("rank", r) for r in range(N)] if R == N - 1 else None), got
    assert objects.scatter_object([r * 10 for r in range(N)] if R == 1 else None,
                                  root_rank=1) == R * 10


run_cases({"eager_any_order": eager_any_order, "step_time_stale": step_time_stale,
           "sparse_rows": sparse_rows, "compression": compression,
           "mismatch_then_work_step_time": lambda: mismatch_then_work(eager=False),
           "mismatch_then_work_eager": lambda: mismatch_then_work(eager=True),
           "one_agreement_per_step_step_time": lambda: one_agreement_per_step(eager=False),
           "one_agreement_per_step_eager": lambda: one_agreement_per_step(eager=True),
           "gather_and_scatter_objects": gather_and_scatter_objects}, rank=R)
