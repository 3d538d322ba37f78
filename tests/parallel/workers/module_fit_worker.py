"""Module.fit with DistributedOptimizer on each rank's shard vs one process on the global batch.

Every rank also runs the single-process reference itself (plain optimizer, no communication)
on the whole data set, so the comparison needs nothing from the other ranks. Rank 0's initial
weights reach the others through broadcast_parameters. The last case is Horovod's older Gluon
recipe, gluon.Trainer(kvstore=None) with a DistributedOptimizer. Each is a case of its own
(case_runner.py).
"""
import logging
import pickle
import warnings

import mxnet as mx
import numpy as np

import hvd_trainer.mxnet as hvd
from case_runner import run_cases

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
BATCH, STEPS, FEATURES, CLASSES = 8, 4, 12, 4
logging.getLogger().setLevel(logging.ERROR)


def network() -> mx.sym.Symbol:
    data = mx.sym.Variable("data")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=10, name="fc1"), "relu")
    logits = mx.sym.FullyConnected(hidden, num_hidden=CLASSES, name="fc2")
    return mx.sym.SoftmaxOutput(logits, name="softmax")


def initial_params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"fc1_weight": (10, FEATURES), "fc1_bias": (10,),
              "fc2_weight": (CLASSES, 10), "fc2_bias": (CLASSES,)}
    return {k: mx.nd.array(rng.normal(0, 0.3, s)) for k, s in shapes.items()}


def fit(x: np.ndarray, y: np.ndarray, batch: int, optimizer, params: dict, kvstore) -> dict:
    it = mx.io.NDArrayIter(x, y, batch_size=batch, shuffle=False, label_name="softmax_label")
    mod = mx.mod.Module(network(), context=mx.cpu())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod.fit(it, num_epoch=1, optimizer=optimizer, arg_params=params, kvstore=kvstore,
                eval_metric="acc")
    # Module warns when rescale_grad is not 1/batch; the wrapper's reads as 1/(per-rank batch).
    assert not [w for w in caught if "rescale_grad" in str(w.message)], caught[0].message
    return {k: v.asnumpy() for k, v in mod.get_params()[0].items()}


rng = np.random.default_rng(7)
X = rng.normal(size=(SIZE * BATCH * STEPS, FEATURES)).astype(np.float32)
Y = rng.integers(0, CLASSES, size=len(X)).astype(np.float32)
# Batch k of rank r is rows [k*G + r*B, k*G + (r+1)*B) of the global batch k (G = SIZE*B).
mine = np.concatenate([np.arange(k * SIZE * BATCH + RANK * BATCH,
                                 k * SIZE * BATCH + (RANK + 1) * BATCH) for k in range(STEPS)])

CASES = [  # (optimizer factory, DistributedOptimizer options, kvstore)
    (lambda rescale: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                                      rescale_grad=rescale, clip_gradient=5.0,
                                      lr_scheduler=mx.lr_scheduler.FactorScheduler(2, 0.5, base_lr=0.1)),
     {}, None),
    (lambda rescale: mx.optimizer.Adam(learning_rate=0.01, wd=1e-3, rescale_grad=rescale),
     {"gradient_predivide_factor": 2.0, "num_groups": 2}, "local"),
    (lambda rescale: mx.optimizer.SGD(learning_rate=0.1, momentum=0.5, rescale_grad=rescale),
     {"num_groups": 3}, "local"),
]


def module_fit(index: int) -> None:
    make, options, kvstore = CASES[index]
    reference = fit(X, Y, SIZE * BATCH, make(1.0 / (SIZE * BATCH)), initial_params(1),
                    kvstore)

    inner = make(1.0 / BATCH)
    opt = hvd.DistributedOptimizer(inner, **options)
    factor = options.get("gradient_predivide_factor", 1.0)
    assert abs(inner.rescale_grad - factor / (BATCH * SIZE)) < 1e-12, inner.rescale_grad
    assert opt.rescale_grad == 1.0 / BATCH
    params = initial_params(1 if RANK == 0 else 100 + RANK)  # only rank 0's survive
    hvd.broadcast_parameters(params, root_rank=0)
    got = fit(X[mine], Y[mine], BATCH, opt, params, kvstore)

    for name, want in reference.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{type(inner).__name__} {options}: {name}")
    assert opt.idx2name == inner.idx2name and inner.idx2name, "idx2name must reach the optimizer"


def gluon_steps(x: np.ndarray, y: np.ndarray, batch: int, optimizer) -> list:
    """STEPS steps of gluon.Trainer(kvstore=None) on consecutive batches of (x, y)."""
    net = mx.gluon.nn.Dense(CLASSES, in_units=FEATURES)
    net.initialize()
    params = net.collect_params()
    rng = np.random.default_rng(3)
    for p in params.values():
        p.set_data(mx.nd.array(rng.normal(0, 0.3, p.shape)))
    trainer = mx.gluon.Trainer(params, optimizer, kvstore=None)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    for k in range(STEPS):
        rows = slice(k * batch, (k + 1) * batch)
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(x[rows])), mx.nd.array(y[rows]))
        loss.backward()
        trainer.step(batch)
    return [p.data().asnumpy() for p in params.values()]  # weight, bias


def gluon_trainer_with_distributed_optimizer() -> None:
    reference = gluon_steps(X, Y, SIZE * BATCH, mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    got = gluon_steps(X[mine], Y[mine], BATCH,
                      hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9)))
    for name, g, want in zip(("weight", "bias"), got, reference):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5, err_msg=f"gluon.Trainer {name}")


def delegation_and_pickling() -> None:
    """Delegation and pickling keep the wrapper transparent."""
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.9))
    opt.set_learning_rate(0.25)
    assert opt._optimizer.lr == 0.25 and opt.learning_rate == 0.25
    state = opt.create_state_multi_precision(0, mx.nd.ones((2, 2)))
    assert state is not None and state.shape == (2, 2), "momentum state comes from the wrapped SGD"
    restored = pickle.loads(pickle.dumps(opt))
    assert isinstance(restored, hvd.DistributedOptimizer)
    assert restored.rescale_grad == opt.rescale_grad and restored.momentum == 0.9


run_cases({"module_fit_sgd_clip_lr_scheduler": lambda: module_fit(0),
           "module_fit_adam_predivide_num_groups_2": lambda: module_fit(1),
           "module_fit_sgd_num_groups_3": lambda: module_fit(2),
           "gluon_trainer_with_distributed_optimizer": gluon_trainer_with_distributed_optimizer,
           "delegation_and_pickling": delegation_and_pickling}, rank=RANK)
