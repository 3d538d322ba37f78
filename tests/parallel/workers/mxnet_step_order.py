"""What a Gluon script does between backward and step, and inside the step, with
DistributedTrainer, against hand-computed weights (SGD, lr 0.125, loss = sum over the used
parameters of p . [0, 1, 2, 3], so each used parameter's gradient is [0, 1, 2, 3] on each
rank that uses it; ranks other than 0 use only parameters 0 and 2, so 1 and 3 are stale there;
MXNet holds the learning rate and 1/size in float32, hence the tolerance).

sync_between_backward_and_step   a synchronous allreduce of the loss between backward() and
                                 step(): the losses' sum against NumPy, then the weights
async_between_backward_and_step  the same through the core's asynchronous submit, waited
                                 for after step()
collective_inside_the_step       an optimizer whose every update makes a collective; with
                                 HVD_OVERLAP=1 the updates of the first buckets run while
                                 later buckets are still reduced (the step is still open)
Run with HVD_BUCKET_THRESHOLD=32 (one bucket per parameter); the test runs it with
HVD_OVERLAP=0 and 1.
"""
import mxnet as mx
import numpy as np

import hvd_trainer
import hvd_trainer.mxnet as hvd
from case_runner import run_cases
from hvd_trainer.coordination import handles

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
RAMP = np.arange(4.0)
STEPS = 12
USED_HERE = [0, 1, 2, 3] if RANK == 0 else [0, 2]
USED_COUNT = [SIZE, 1, SIZE, 1]
failures = []


def weights(step: int) -> np.ndarray:
    """The parameters' values after ``step`` steps, by hand."""
    return np.stack([1 - step * 0.125 * USED_COUNT[i] / SIZE * RAMP for i in range(4)])


def loss_of(values: np.ndarray, used: list) -> float:
    return float(sum(values[i] @ RAMP for i in used))


class CountingSGD(mx.optimizer.SGD):
    """SGD whose every update first makes a collective (a sum of ones: SIZE)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sums = []

    def update_multi_precision(self, index, weight, grad, state):
        one = hvd.allreduce(mx.nd.ones(1, dtype="float64"), op=hvd.Sum)
        self.sums.append(float(one.asscalar()))
        super().update_multi_precision(index, weight, grad, state)


def train(between=None, optimizer="sgd") -> None:
    params = [mx.gluon.Parameter(f"p{i}", shape=(4,), dtype="float64", init=mx.init.One())
              for i in range(4)]
    for p in params:
        p.initialize()
    trainer = hvd.DistributedTrainer(params, optimizer,
                                     {"learning_rate": 0.125} if optimizer == "sgd" else None,
                                     prefix=f"{len(failures)}.")
    ramp = mx.nd.array(RAMP, dtype="float64")
    for step in range(STEPS):
        with mx.autograd.record():
            loss = mx.nd.add_n(*[(params[i].data() * ramp).sum() for i in USED_HERE])
        loss.backward()
        finish = between(loss, step) if between else None
        trainer.step(1)
        if finish:
            finish()
    got = np.stack([p.data().asnumpy() for p in params])
    if not np.allclose(got, weights(STEPS), rtol=1e-6, atol=1e-6):
        failures.append(f"rank {RANK}: weights {got.tolist()}, by hand {weights(STEPS).tolist()}")


def expected_loss_sum(step: int) -> float:
    return sum(loss_of(weights(step), [0, 1, 2, 3] if r == 0 else [0, 2]) for r in range(SIZE))


def sync_between(loss, step):
    got = float(hvd.allreduce(loss, op=hvd.Sum, name="loss").asscalar())
    if not np.isclose(got, expected_loss_sum(step), rtol=1e-6, atol=1e-6):
        failures.append(f"step {step}: the losses' sum is {got}, NumPy's "
                        f"{expected_loss_sum(step)}")


def async_between(loss, step):
    handle = handles.submit(hvd_trainer.allreduce, loss.asnumpy(), op=hvd_trainer.Sum,
                            name="loss")

    def finish():
        got = float(handle.wait()[0])
        if not np.isclose(got, expected_loss_sum(step), rtol=1e-6, atol=1e-6):
            failures.append(f"step {step}: the async losses' sum is {got}, NumPy's "
                            f"{expected_loss_sum(step)}")
    return finish


def inside_the_step():
    optimizer = CountingSGD(learning_rate=0.125)
    train(optimizer=optimizer)
    if not optimizer.sums or set(optimizer.sums) != {float(SIZE)}:
        failures.append(f"the collectives inside the updates summed to {set(optimizer.sums)}, "
                        f"want {{{SIZE}.0}}")


run_cases({"sync_between_backward_and_step": lambda: train(sync_between),
           "async_between_backward_and_step": lambda: train(async_between),
           "collective_inside_the_step": inside_the_step}, failures, RANK)
