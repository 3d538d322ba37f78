"""row_sparse weights: N ranks with DistributedTrainer == one gluon.Trainer on the global batch.

The reference is MXNet's own path for such weights: one process, ``gluon.Trainer`` with
``kvstore='device'`` (which keeps the weight in the KVStore and updates it there), fed the
whole global batch. Three models:

- ``bag``: contrib.nn.SparseEmbedding -> sum over tokens -> Dense;
- ``factors``: matrix factorisation, user and item factors as ``Parameter(stype='row_sparse',
  grad_stype='row_sparse')`` read with ``row_sparse_data``, plus dense biases;
- ``linear``: a linear model on CSR features, ``sparse.dot(x, weight.row_sparse_data(ids))``;
- ``lookup``: Embedding lookups of a row_sparse weight with a dense gradient
  (``grad_stype='default'``). gluon.Trainer cannot step it (MXNet 1.9.1's step asks the
  weight for list_data()), so its reference is the same model with a dense weight: the whole
  weight updated with the dense gradient, which is what the KVStore does with such a weight.

Every rank draws the same global batches (sparse_equivalence.batches, its 0/1 labels serving
as targets); row 7 is in every sample (a duplicate within and across ranks). In ``skip``
steps the last rank does not use its row_sparse weights (it sends no rows), which the
reference mirrors block by block. Each case checks which way the rows
travelled, that all ranks hold the same weights, that they match the reference, and, for
lazy updates, that rows no rank ever touched still hold their starting values.
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon.contrib.nn import SparseEmbedding

import hvd_trainer
from case_runner import run_cases
from sparse_equivalence import DIM, PER_RANK, STEPS, batches
from trainer_common import close, same_on_all_ranks, seed_per_rank


class Bag(gluon.Block):
    """SparseEmbedding -> sum over tokens -> Dense(1); ``skip`` bypasses the embedding."""

    def __init__(self, rows: int):
        super().__init__()
        with self.name_scope():
            self.embed = SparseEmbedding(rows, DIM)
            self.out = gluon.nn.Dense(1, in_units=DIM)

    def forward(self, ids, skip=False):
        hidden = ids.slice_axis(1, 0, DIM) / 10 if skip else self.embed(ids).sum(axis=1)
        return self.out(hidden)


class Factors(gluon.Block):
    """score = <user factors, item factors> + user bias + item bias; ids are (user, item)."""

    def __init__(self, rows: int):
        super().__init__()
        with self.name_scope():
            self.users = self.params.get("users", shape=(rows, DIM), stype="row_sparse",
                                         grad_stype="row_sparse")
            self.items = self.params.get("items", shape=(rows, DIM), stype="row_sparse",
                                         grad_stype="row_sparse")
            self.user_bias = gluon.nn.Embedding(rows, 1)

    def forward(self, ids, skip=False):
        user, item = ids[:, 0], ids[:, 1]
        if skip:
            return self.user_bias(user).reshape(-1)
        rows = self.users.shape[0]
        u = mx.nd.Embedding(user, self.users.row_sparse_data(user), rows, DIM, sparse_grad=True)
        v = mx.nd.Embedding(item, self.items.row_sparse_data(item), rows, DIM, sparse_grad=True)
        return (u * v).sum(axis=1) + self.user_bias(user).reshape(-1)


class Linear(gluon.Block):
    """A linear model on CSR features whose weight is row_sparse."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows
        with self.name_scope():
            self.weight = self.params.get("weight", shape=(rows, 1), stype="row_sparse",
                                          grad_stype="row_sparse")
            self.bias = self.params.get("bias", shape=(1,), init="zeros")

    def forward(self, ids, skip=False):
        if skip:
            return self.bias.data().broadcast_to((ids.shape[0], 1))
        features = _csr(ids, self.rows)
        weight = self.weight.row_sparse_data(features.indices)
        return mx.nd.sparse.dot(features, weight) + self.bias.data()


def _csr(ids: mx.nd.NDArray, rows: int) -> mx.nd.NDArray:
    """Samples whose features are the given ids, each with value 1 + id / 100 (sums repeats)."""
    ctx, ids = ids.context, ids.asnumpy().astype(np.int64)
    dense = np.zeros((ids.shape[0], rows), np.float32)
    for r, sample in enumerate(ids):
        np.add.at(dense[r], sample, 1 + sample / 100)
    return mx.nd.array(dense, ctx=ctx).tostype("csr")


class Lookup(gluon.Block):
    """Embedding lookups of a ``Parameter(stype='row_sparse', grad_stype='default')`` read with
    ``row_sparse_data``: a row_sparse weight with a dense gradient; ``skip`` bypasses it."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows
        with self.name_scope():
            self.table = self.params.get("table", shape=(rows, DIM), stype="row_sparse",
                                         grad_stype="default")
            self.out = gluon.nn.Dense(1, in_units=DIM)

    def _table(self, ids):
        return self.table.row_sparse_data(ids)

    def forward(self, ids, skip=False):
        if skip:
            return self.out(ids.slice_axis(1, 0, DIM) / 10)
        return self.out(mx.nd.Embedding(ids, self._table(ids), self.rows, DIM).sum(axis=1))


class DenseLookup(Lookup):
    """Lookup with a dense weight: the reference. gluon.Trainer cannot step a row_sparse
    weight with a dense gradient (MXNet 1.9.1 asks it for list_data()); what its KVStore
    would do, update the whole weight with the dense gradient, is a dense weight's update."""

    def __init__(self, rows: int):
        gluon.Block.__init__(self)
        self.rows = rows
        with self.name_scope():
            self.table = self.params.get("table", shape=(rows, DIM))
            self.out = gluon.nn.Dense(1, in_units=DIM)

    def _table(self, ids):
        return self.table.data(ids.context)


MODELS = {"bag": Bag, "factors": Factors, "linear": Linear, "lookup": Lookup}
REFERENCES = {"lookup": DenseLookup}


def forward_backward(net, blocks, ctxs):
    """Forward each (ids, targets, skip) block split over ``ctxs``; backward the squared error."""
    with autograd.record():
        losses = []
        for ids, targets, skip in blocks:
            for i, t, c in zip(np.array_split(ids, len(ctxs)), np.array_split(targets, len(ctxs)),
                               ctxs):
                out = net(mx.nd.array(i, ctx=c), skip).reshape(-1)
                losses.append(((out - mx.nd.array(t, ctx=c)) ** 2).sum())
    autograd.backward(losses)


def values(net):
    """Every weight in full, dense; row_sparse ones through row_sparse_data(every row)."""
    out = []
    for p in net.collect_params().values():
        if p._stype == "row_sparse":
            every = mx.nd.arange(p.shape[0], ctx=p.list_ctx()[0])
            out.append(p.row_sparse_data(every).tostype("default").asnumpy())
        else:
            out.append(p.list_data()[0].asnumpy())
    return out


def sparse_params(net):
    """The row_sparse weights with row_sparse gradients (those have sparse exchanges)."""
    return [p for p in net.collect_params().values() if p._grad_stype == "row_sparse"]


CASES = [
    # name, model, rows, id range, optimizer, params, options
    ("bag: sgd lazy, momentum, wd; last rank idle at step 1", "bag", 100, 30, "sgd",
     {"learning_rate": 0.2, "momentum": 0.9, "wd": 0.01}, dict(skip_step=1)),
    ("bag: sgd not lazy, momentum, wd, gradient_predivide_factor=2", "bag", 100, 30, "sgd",
     {"learning_rate": 0.2, "momentum": 0.9, "wd": 0.01, "lazy_update": False},
     dict(kwargs={"gradient_predivide_factor": 2.0})),
    ("bag: adam lazy; last rank idle at step 2", "bag", 100, 30, "adam",
     {"learning_rate": 0.05}, dict(skip_step=2)),
    ("bag: adam not lazy", "bag", 100, 30, "adam", {"learning_rate": 0.05, "lazy_update": False},
     {}),
    ("bag: every row at step 0, then rows 0..5 of 8: dense fallback, sgd lazy wd", "bag", 8, 6,
     "sgd", {"learning_rate": 0.2, "momentum": 0.9, "wd": 0.01}, dict(all_rows=True, dense=True)),
    ("bag: two contexts per process, adam lazy", "bag", 100, 30, "adam",
     {"learning_rate": 0.05}, dict(ctxs=[mx.cpu(0), mx.cpu(1)])),
    ("factors: Parameter(stype='row_sparse'), adam lazy; last rank idle at step 0", "factors",
     60, 40, "adam", {"learning_rate": 0.05}, dict(skip_step=0)),
    ("factors: sparse_as_dense=True, sgd lazy, momentum, wd", "factors", 60, 40, "sgd",
     {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01},
     dict(dense=True, kwargs={"sparse_as_dense": True})),
    ("linear: CSR features, sgd lazy, momentum, wd", "linear", 80, 50, "sgd",
     {"learning_rate": 0.05, "momentum": 0.9, "wd": 0.01}, {}),
    ("lookup: dense gradient, sgd, momentum, wd; last rank idle at step 1", "lookup", 60, 40,
     "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}, dict(skip_step=1)),
    ("lookup: dense gradient, adam, two contexts per process", "lookup", 60, 40, "adam",
     {"learning_rate": 0.05}, dict(ctxs=[mx.cpu(0), mx.cpu(1)])),
    ("lookup: dense gradient, sgd, gradient_predivide_factor=2, HVD_OVERLAP=1", "lookup", 60,
     40, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
     dict(kwargs={"gradient_predivide_factor": 2.0}, overlap=True)),
]


def run_case(index, name, model, rows, high, optimizer, opt_params, skip_step=None,
             all_rows=False, dense=False, ctxs=(mx.cpu(),), kwargs=None, overlap=False):
    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    data = batches(rows, high, all_rows, seed=index)
    seed_per_rank()
    net = MODELS[model](rows)
    net.initialize(mx.init.Uniform(0.5), ctx=list(ctxs))
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), optimizer, dict(opt_params),
                                             prefix=f"rsw{index}.", **(kwargs or {}))
    if overlap:  # what HVD_OVERLAP=1 sets, for this trainer only (the setting is the job's)
        trainer._reducer.overlap = True
    start = values(net)
    paths = []
    for step, (ids, targets) in enumerate(data):
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        forward_backward(net, [(ids[mine], targets[mine],
                                step == skip_step and rank == size - 1)], ctxs)
        trainer.step(PER_RANK)
        paths.append([trainer.sparse_exchanges[p.name].dense for p in sparse_params(net)])
    expected = [[dense] * len(sparse_params(net))] * STEPS
    assert paths == expected, f"{name}: dense paths per step {paths}, expected {expected}"
    got = values(net)
    same_on_all_ranks(got, f"{name}: weights after training")
    if rank != 0:
        return
    ref = REFERENCES.get(model, MODELS[model])(rows)
    ref.initialize(ctx=mx.cpu())
    for p, value in zip(ref.collect_params().values(), start):
        p.set_data(mx.nd.array(value))
    ref_trainer = gluon.Trainer(ref.collect_params(), optimizer, dict(opt_params),
                                kvstore="device")
    touched = np.zeros(rows, bool)
    for step, (ids, targets) in enumerate(data):
        blocks = [(ids[r * PER_RANK:(r + 1) * PER_RANK],
                   targets[r * PER_RANK:(r + 1) * PER_RANK], step == skip_step and r == size - 1)
                  for r in range(size)]
        for block_ids, _, skip in blocks:
            touched[block_ids.astype(np.int64).ravel()] |= not skip
        forward_backward(ref, blocks, [mx.cpu()])
        ref_trainer.step(size * PER_RANK)
    worst = close(got, values(ref), 1e-5, 1e-6, name)
    if opt_params.get("lazy_update", True) and not touched.all():
        for p, before, after in zip(net.collect_params().values(), start, got):
            if p._grad_stype == "row_sparse":  # a dense gradient updates every row
                assert np.array_equal(before[~touched], after[~touched]), \
                    f"{name}: a lazy update changed rows no rank touched"
    path = "allreduce" if model in REFERENCES else "dense" if dense else "sparse"
    reference = "a dense twin" if model in REFERENCES else "kvstore='device'"
    print(f"{name}: {path} path, max |diff| vs gluon.Trainer ({reference}) on the global "
          f"batch {worst:.2g}", flush=True)


def check_broadcast_parameters():
    """hvd.broadcast_parameters gives every rank the root's row_sparse weights, before a
    trainer serves them and after (when the trainer's copy is what it replaces)."""
    seed_per_rank()
    net = Bag(50)
    net.initialize(mx.init.Uniform(0.5))
    root = hvd_trainer.broadcast_object(net.embed.weight._data[0].tostype("default").asnumpy())
    hvd_trainer.broadcast_parameters(net.collect_params(), prefix="bp.")
    assert np.array_equal(net.embed.weight._data[0].tostype("default").asnumpy(), root)
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                             prefix="bp.trainer.")
    mine = np.full((50, DIM), hvd_trainer.rank() + 1.0, np.float32)
    net.embed.weight.set_data(mx.nd.array(mine))  # every rank's trainer now holds its own
    net.embed.weight.row_sparse_data(mx.nd.array([1, 2]))  # the arrays now hold 2 rows only
    hvd_trainer.broadcast_parameters(net.collect_params(), prefix="bp.again.")
    assert np.array_equal(values(net)[0], np.ones((50, DIM), np.float32))
    forward_backward(net, [(np.arange(10.0).reshape(2, 5), np.zeros(2), False)], [mx.cpu()])
    trainer.step(2)
    same_on_all_ranks(values(net), "broadcast_parameters, then one step")
    if hvd_trainer.rank() == 0:
        print("broadcast_parameters: row_sparse weights, before and after a trainer serves "
              "them", flush=True)


def case(index):
    name, model, rows, high, optimizer, opt_params, options = CASES[index]
    return lambda: run_case(index, name, model, rows, high, optimizer, opt_params, **options)


def main():
    run_cases({"bag_sgd_lazy_last_rank_idle": case(0), "bag_sgd_not_lazy_predivide": case(1),
               "bag_adam_lazy_last_rank_idle": case(2), "bag_adam_not_lazy": case(3),
               "bag_dense_fallback_sgd_lazy": case(4), "bag_two_contexts_adam_lazy": case(5),
               "factors_parameter_row_sparse_adam": case(6),
               "factors_sparse_as_dense_sgd": case(7), "linear_csr_features_sgd": case(8),
               "lookup_dense_gradient_sgd": case(9),
               "lookup_dense_gradient_adam_two_contexts": case(10),
               "lookup_dense_gradient_predivide_overlap": case(11),
               "broadcast_parameters": check_broadcast_parameters}, rank=hvd_trainer.rank())


if __name__ == "__main__":
    main()
