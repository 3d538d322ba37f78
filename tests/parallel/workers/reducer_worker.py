"""The reducer on plain NumPy gradients across ranks, checked against NumPy sums of what every
rank contributed (each rank can compute every rank's inputs from the seed).

Cases: eager readiness in a different order on every rank, from threads; step-time readiness
with stale and fresh-nowhere gradients; predivision; row-sparse gradients; fp16 and 2-bit
compression (2-bit against MXNet's rule by hand); an agreement mismatch raised on every rank,
then a working step; residual state gathered to the first rank only and scattered back.
Comm hooks: a compressed bucket reduced while later gradients are still to come; top-k in a
fused bucket against a per-gradient NumPy model, and the same bits whatever the buckets; the
Adasum hook against a NumPy tree; a user's hook whose future completes later on a thread of
its own, and one whose collectives disagree (raised on every rank, then a working step).
Each case reports on its own (case_runner.py).
"""
import math
import random
import threading
import time
from concurrent.futures import Future

import numpy as np

import hvd_trainer
from case_runner import run_cases
from hvd_trainer.coordination import messages, scheduler
from hvd_trainer.collectives import objects
from hvd_trainer.runtime import runtime
from hvd_trainer.collectives.adasum import AdasumSizeError
from hvd_trainer.compression import Compression, TopK, TwoBit
from hvd_trainer.training import hook_state, hooks
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


def run_step(reducer):
    """Close the reducer's step and finish it: (the step, the per-tensor results)."""
    step, _ = reducer.close()
    results, _ = reducer.finish(step)
    return step, results


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
        t = threading.Thread(target=reducer.mark, args=(key, given.get(key)))
        t.start()
        t.join()
    step, results = run_step(reducer)
    assert all(h.poll() for h in step.handles)
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
        reducer.mark(key, value)
    step, results = run_step(reducer)
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
    reducer.mark(0, (np.array([R, R + 2, 9]), values(R, 0, (3, 3))))
    ids, rows = run_step(reducer)[1][0]
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
    got = back(fp16)[0]  # compressed gradients travel in buckets too
    got[...] = values(R, 0, (6,))
    fp16.mark(0)
    run_step(fp16)
    want = sum(values(r, 0, (6,)).astype(np.float16).astype(np.float32) for r in range(N))
    close(got, want, "fp16", tol=1e-2)
    assert got.dtype == np.float32 and fp16.stats.bytes_sent > 0
    codec = TwoBit(0.3)
    codec.min_size = 1
    two = make(compression=codec)
    two.set_gradients([Gradient(0, (40,), "<f4")])
    got = back(two)[0]
    steps = 3
    for s in range(steps):
        got[...] = values(R, 0, (40,), s)
        two.mark(0)
        run_step(two)
        want = sum(two_bit_by_hand([values(r, 0, (40,), t) for t in range(s + 1)],
                                   np.float32(0.3))[0][-1] for r in range(N))
        assert np.array_equal(got, want), f"rank {R} 2-bit step {s}"
    # Residuals gathered to the first rank alone, then scattered back to a new reducer.
    state = hook_state.gather(two, "residuals")
    residuals = [two_bit_by_hand([values(r, 0, (40,), t) for t in range(steps)],
                                 np.float32(0.3))[1] for r in range(N)]
    if R == 0:
        assert state["size"] == N and len(state["residuals"]) == N
        for r in range(N):
            close(state["residuals"][r][0], residuals[r], f"gathered residual of rank {r}")
    else:
        assert state is None
    fresh = make(compression=codec)
    hook_state.scatter(fresh, state if R == 0 else None, "residuals")
    close(hook_state.kept(fresh).residuals[0], residuals[R], "scattered residual")


def mismatch_then_work(eager):
    reducer = make(eager=eager)
    shape = (4,) if R == 0 else (5,)
    reducer.set_gradients([Gradient(0, shape, "<f4")])
    back(reducer)
    reducer.mark(0)
    step, _ = reducer.close()
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
    reducer.mark(0)
    run_step(reducer)
    close(views[0], np.full(4, N * (N + 1) / 2), "after mismatch")


def one_agreement_per_step(eager):
    reducer = make(eager=eager)
    reducer.set_gradients([Gradient(k, s, "<f4") for k, s in enumerate(SHAPES)]
                          + [Gradient(9, (), "<f4")])
    back(reducer)
    comm = runtime.communicator(hvd_trainer.global_process_set)
    before = scheduler.of(comm).exchanges
    for _ in range(3):
        for key in list(range(len(SHAPES))) + [9]:
            reducer.mark(key, np.ones((), np.float32) if key == 9 else None)
        run_step(reducer)
    assert scheduler.of(comm).exchanges - before == 3, f"eager={eager}"



def waited(handle, what):
    """``handle``'s result, failing (not hanging) if it takes over a minute."""
    deadline = time.monotonic() + 60
    while not handle.poll():
        assert time.monotonic() < deadline, f"rank {R}: {what} did not finish"
        time.sleep(0.001)
    return handle.wait()


def compressed_bucket_before_backward_ends():
    """A 2-bit bucket is reduced while the other bucket's gradients are still to come (eager,
    fused and overlapped like an uncompressed one), and sums as MXNet's rule by hand."""
    codec = TwoBit(0.3)
    codec.min_size = 1
    reducer = make(eager=True, compression=codec)
    reducer.set_gradients([Gradient(k, (6,), "<f4") for k in range(4)])
    assert [b.keys for b in reducer.buckets] == [[3, 2], [1, 0]], reducer.buckets
    views = back(reducer)
    for key in range(4):
        views[key][...] = values(R, key, (6,))
    reducer.mark(3)
    reducer.mark(2)
    step = reducer._step
    waited(step.handles[0], "the first bucket")  # while keys 1 and 0 are not marked yet
    reducer.mark(1)
    reducer.mark(0)
    run_step(reducer)
    for key in range(4):
        want = sum(two_bit_by_hand([values(r, key, (6,))], np.float32(0.3))[0][0]
                   for r in range(N))
        assert np.array_equal(views[key], want), f"rank {R} 2-bit key {key}"


def top_k_by_hand(grads, ratio):
    """Top-k with error feedback on one rank's gradient over steps, by argsort: what it
    sends at each step."""
    residual, sent = np.zeros_like(grads[0]), []
    for g in grads:
        residual = residual + g
        k = min(residual.size, max(1, math.ceil(ratio * residual.size)))
        keep = np.argsort(-np.abs(residual), kind="stable")[:k]
        out = np.zeros_like(residual)
        out[keep] = residual[keep]
        residual[keep] = 0
        sent.append(out)
    return sent


def top_k_per_gradient_in_a_fused_bucket():
    """Top-k sends the ratio of each gradient, not of the bucket: one fused bucket of three
    gradients of different scales against the per-gradient rule by hand, over three steps;
    bit for bit the same as with one bucket per gradient."""
    shapes = [(40,), (3, 10), (25,)]
    scales = [1.0, 100.0, 0.01]  # per bucket, the large one would take every entry
    got = {}
    for threshold in (4096, 4):
        codec = TopK(0.1)
        codec.min_size = 1
        reducer = make(compression=codec)
        reducer.bucket_threshold = threshold
        reducer.set_gradients([Gradient(k, s, "<f4") for k, s in enumerate(shapes)])
        assert len(reducer.buckets) == (1 if threshold > 4 else 3)
        views = back(reducer)
        for step in range(3):
            for key, shape in enumerate(shapes):
                views[key][...] = values(R, key, shape, step) * scales[key]
            reducer.mark_all((key, None) for key in range(len(shapes)))
            run_step(reducer)
            got[threshold, step] = [views[key].copy() for key in range(len(shapes))]
    for step in range(3):
        for key, shape in enumerate(shapes):
            want = sum(top_k_by_hand([values(r, key, shape, t).reshape(-1) * scales[key]
                                      for t in range(step + 1)], 0.1)[-1] for r in range(N))
            assert np.array_equal(got[4096, step][key].reshape(-1), want), \
                f"rank {R}: top-k step {step} key {key}"
            assert np.array_equal(got[4096, step][key], got[4, step][key]), \
                f"rank {R}: top-k differs with the bucket layout at step {step} key {key}"


def adasum_by_hand(vectors):
    """Adasum's binary tree over the ranks' float64 vectors, written out."""
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        pairs = []
        for a, b in zip(level[::2], level[1::2]):
            dot = a @ b
            pairs.append((1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b)
        level = pairs
    return level[0]


def adasum_hook_combines_each_gradient():
    reducer = make()
    reducer.register_comm_hook(None, hooks.adasum_hook)
    reducer.set_gradients([Gradient(k, s, "<f4") for k, s in enumerate(SHAPES)])
    views = back(reducer)
    for key, shape in enumerate(SHAPES):
        views[key][...] = values(R, key, shape)
    reducer.mark_all((key, None) for key in range(len(SHAPES)))
    if N & (N - 1):
        try:
            run_step(reducer)
        except AdasumSizeError:
            return
        raise AssertionError(f"rank {R}: Adasum on {N} ranks did not raise")
    run_step(reducer)
    for key, shape in enumerate(SHAPES):
        want = adasum_by_hand([values(r, key, shape).reshape(-1) for r in range(N)])
        close(views[key].reshape(-1), want, f"adasum key {key}", tol=1e-5)


def user_hook_with_a_later_future():
    """A user's hook sums with hvd_trainer.allreduce (its own agreements) into a new array
    and hands it over from a thread of its own; the next bucket's hook is called before."""
    events = []

    def later(state, bucket):
        summed = hvd_trainer.allreduce(bucket.buffer, op=hvd_trainer.Sum,
                                       name=f"user.{bucket.index}",
                                       prescale_factor=bucket.prescale)
        state["calls"] += 1
        events.append(("called", bucket.index))
        future = Future()

        def finish():
            time.sleep(0.05)
            events.append(("done", bucket.index))
            future.set_result(summed)
        threading.Thread(target=finish).start()
        return future

    reducer = make(gradient_predivide_factor=2.0)
    state = {"calls": 0}
    reducer.register_comm_hook(state, later)
    reducer.set_gradients([Gradient(k, s, "<f4") for k, s in enumerate(SHAPES)])
    assert len(reducer.buckets) > 2
    views = back(reducer)
    for key, shape in enumerate(SHAPES):
        views[key][...] = values(R, key, shape)
    reducer.mark_all((key, None) for key in range(len(SHAPES)))
    run_step(reducer)
    assert state["calls"] == len(reducer.buckets)
    assert events.index(("called", 1)) < events.index(("done", 0)), events
    for key, shape in enumerate(SHAPES):
        close(views[key], sum(values(r, key, shape) for r in range(N)) / 2.0, f"user {key}")


def user_hook_that_disagrees():
    """A user's hook whose allreduce has another shape on rank 0: a MismatchError on every
    rank, not a hang; the next step, with a sound hook, works."""
    def bad(state, bucket):
        part = bucket.buffer[:1] if R == 0 else bucket.buffer
        hvd_trainer.allreduce_(part, op=hvd_trainer.Sum, name="user.bad")
        return hooks.done(bucket.buffer)

    reducer = make()
    reducer.register_comm_hook(None, bad)
    reducer.set_gradients([Gradient(0, (4,), "<f4")])
    views = back(reducer)
    reducer.mark(0)
    step, _ = reducer.close()
    try:
        reducer.finish(step)
    except messages.MismatchError:
        pass
    else:
        raise AssertionError(f"rank {R}: no MismatchError from the user's hook")
    reducer = make(prefix="sound.")
    reducer.set_gradients([Gradient(0, (4,), "<f4")])
    views = back(reducer)
    views[0][...] = R + 1
    reducer.mark(0)
    run_step(reducer)
    close(views[0], np.full(4, N * (N + 1) / 2), "after the user's hook failed")


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
           "gather_and_scatter_objects": gather_and_scatter_objects,
           "compressed_bucket_before_backward_ends": compressed_bucket_before_backward_ends,
           "top_k_per_gradient_in_a_fused_bucket": top_k_per_gradient_in_a_fused_bucket,
           "adasum_hook_combines_each_gradient": adasum_hook_combines_each_gradient,
           "user_hook_with_a_later_future": user_hook_with_a_later_future,
           "user_hook_that_disagrees": user_hook_that_disagrees}, rank=R)
