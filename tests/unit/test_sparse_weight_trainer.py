"""row_sparse weights under DistributedTrainer in a one-rank world, against gluon.Trainer with
kvstore='device' (MXNet's own path for them): serving rows, updates, saving and loading.
Multi-rank equivalence: tests/parallel/test_sparse_weights.py."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon.contrib.nn import SparseEmbedding

from hvd_trainer.mxnet.trainer import DistributedTrainer

ROWS, DIM = 40, 3


class Bag(gluon.Block):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embed = SparseEmbedding(ROWS, DIM)
            self.out = gluon.nn.Dense(1, in_units=DIM)

    def forward(self, ids):
        return self.out(self.embed(ids).sum(axis=1))


def pair(ctxs=(mx.cpu(),)):
    """A net for DistributedTrainer and a copy with the same weights for gluon.Trainer."""
    net, ref = Bag(), Bag()
    net.initialize(mx.init.Uniform(0.5), ctx=list(ctxs))
    ref.initialize(ctx=list(ctxs))
    for p, q in zip(net.collect_params().values(), ref.collect_params().values()):
        q.set_data(p._data[0])
    return net, ref


def full(param):
    return param.row_sparse_data(mx.nd.arange(param.shape[0])).tostype("default").asnumpy()


def train(net, trainer, ids_batches, ctxs=(mx.cpu(),)):
    for ids in ids_batches:
        with autograd.record():
            losses = [net(mx.nd.array(part, ctx=c)).sum()
                      for part, c in zip(np.array_split(ids, len(ctxs)), ctxs)]
        autograd.backward(losses)
        trainer.step(ids.shape[0])


def id_batches(steps=3, high=20, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, high, (6, 4)).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("ctxs", [(mx.cpu(),), (mx.cpu(0), mx.cpu(1))])
@pytest.mark.parametrize("optimizer, params", [
    ("sgd", {"learning_rate": 0.2, "momentum": 0.9, "wd": 0.01}),
    ("sgd", {"learning_rate": 0.2, "momentum": 0.9, "wd": 0.01, "lazy_update": False}),
    ("adam", {"learning_rate": 0.05}),
])
def test_training_matches_gluon_trainer_with_its_kvstore(optimizer, params, ctxs):
    net, ref = pair(ctxs)
    trainer = DistributedTrainer(net.collect_params(), optimizer, dict(params))
    start = full(net.embed.weight)
    ref_trainer = gluon.Trainer(ref.collect_params(), optimizer, dict(params), kvstore="device")
    batches = id_batches(high=20)
    train(net, trainer, batches, ctxs)
    train(ref, ref_trainer, batches, ctxs)
    got = full(net.embed.weight)
    np.testing.assert_allclose(got, full(ref.embed.weight), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(net.out.weight.data().asnumpy(), ref.out.weight.data().asnumpy(),
                               rtol=1e-5, atol=1e-7)
    moved = (got != start).any(axis=1)
    assert moved[:20].all()
    # Rows 20.. are in no batch: a lazy update leaves them alone, a standard one decays them.
    assert moved[20:].all() == (params.get("lazy_update", True) is False)


def lookup_weight(stype):
    weight = gluon.Parameter("lookup", shape=(ROWS, DIM), stype=stype, grad_stype="default")
    weight.initialize(mx.init.Constant(0.5))
    return weight


def lookup_step(weight, table, ids, trainer, scale):
    with autograd.record():
        loss = (mx.nd.Embedding(ids, table, ROWS, DIM).sum(axis=1) ** 2).sum() * scale
    loss.backward()
    trainer.step(ids.shape[0])


@pytest.mark.parametrize("optimizer, params", [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}),
    ("adam", {"learning_rate": 0.05, "wd": 0.01}),
])
def test_a_dense_gradient_updates_the_whole_weight_as_mxnet_s_kvstore_does(optimizer, params):
    # gluon.Trainer's own step fails on such a weight in MXNet 1.9.1 (it asks for list_data());
    # its KVStore, given the dense gradient, updates every row as a dense weight is updated.
    # So the references are a dense twin under gluon.Trainer, and that KVStore directly.
    weight, twin = lookup_weight("row_sparse"), lookup_weight("default")
    trainer = DistributedTrainer([weight], optimizer, dict(params))
    ref_trainer = gluon.Trainer([twin], optimizer, dict(params), kvstore="device")
    kv = mx.kv.create("device")
    kv.set_optimizer(mx.optimizer.create(optimizer, **params))
    kv.init(0, mx.nd.sparse.row_sparse_array((np.full((ROWS, DIM), 0.5, np.float32),
                                               np.arange(ROWS)), shape=(ROWS, DIM)))
    for step, ids in enumerate(id_batches(high=ROWS // 2)):
        ids = mx.nd.array(ids)
        lookup_step(weight, weight.row_sparse_data(ids), ids, trainer, step + 1)
        lookup_step(twin, twin.data(), ids, ref_trainer, step + 1)
        kv.push(0, twin.grad() / ids.shape[0])  # gluon.Trainer's rescale, done by hand
    by_kvstore = mx.nd.sparse.zeros("row_sparse", (ROWS, DIM))
    kv.row_sparse_pull(0, out=by_kvstore, row_ids=mx.nd.arange(ROWS))
    got = full(weight)
    np.testing.assert_allclose(got, twin.data().asnumpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, by_kvstore.tostype("default").asnumpy(), rtol=1e-6, atol=1e-7)
    assert (got[ROWS // 2:] != 0.5).all()  # rows no batch touched decay too (wd)


def test_gluon_trainer_itself_fails_on_a_row_sparse_weight_with_a_dense_gradient():
    weight = lookup_weight("row_sparse")
    trainer = gluon.Trainer([weight], "sgd", {"learning_rate": 0.1}, kvstore="device")
    ids = mx.nd.array([1, 2])
    with pytest.raises(RuntimeError, match="via list_data\\(\\) because its storage type is "
                                           "row_sparse"):
        lookup_step(weight, weight.row_sparse_data(ids), ids, trainer, 1.0)


def test_row_sparse_data_serves_the_requested_rows_of_the_trainer_s_weight():
    net, _ = pair((mx.cpu(0), mx.cpu(1)))
    DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    weight = net.embed.weight
    whole = full(weight)
    rows = weight.row_sparse_data(mx.nd.array([5, 2, 5, 39], ctx=mx.cpu(1)))
    assert rows.stype == "row_sparse" and rows.context == mx.cpu(1)
    assert rows.indices.asnumpy().tolist() == [2, 5, 39]
    np.testing.assert_array_equal(rows.data.asnumpy(), whole[[2, 5, 39]])
    every = weight.list_row_sparse_data(mx.nd.array([1], dtype="int64"))
    assert [a.context for a in every] == [mx.cpu(0), mx.cpu(1)]
    for array in every:
        assert array.indices.asnumpy().tolist() == [1]
        np.testing.assert_array_equal(array.data.asnumpy(), whole[[1]])
    with pytest.raises(ValueError, match=rf"'{weight.name}'.*row id 40 is outside \[0, 40\)"):
        weight.row_sparse_data(mx.nd.array([3, 40]))


def test_save_parameters_writes_the_trained_weight_and_load_parameters_replaces_it(tmp_path):
    net, ref = pair()
    trainer = DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
    ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.2},
                                kvstore="device")
    train(net, trainer, id_batches())
    train(ref, ref_trainer, id_batches())
    saved = str(tmp_path / "bag.params")
    net.save_parameters(saved)
    loaded = Bag()
    loaded.load_parameters(saved)
    np.testing.assert_allclose(loaded.embed.weight._data[0].tostype("default").asnumpy(),
                               full(ref.embed.weight), rtol=1e-6)
    # Loading into trained nets: both trainers serve and update the loaded weights.
    other = str(tmp_path / "other.params")
    fresh = Bag()
    fresh.initialize(mx.init.Uniform(0.5))
    gluon.Trainer(fresh.collect_params(), "sgd")  # Gluon saves row_sparse weights through one
    fresh.save_parameters(other)
    net.load_parameters(other)
    ref.load_parameters(other)
    np.testing.assert_array_equal(full(net.embed.weight), full(fresh.embed.weight))
    train(net, trainer, id_batches(seed=1))
    train(ref, ref_trainer, id_batches(seed=1))
    np.testing.assert_allclose(full(net.embed.weight), full(ref.embed.weight), rtol=1e-5,
                               atol=1e-7)


def test_checkpoint_resumes_a_row_sparse_weight_exactly(tmp_path):
    batches = id_batches(steps=4)
    net, _ = pair()
    trainer = DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.05})
    train(net, trainer, batches[:2])
    path = str(tmp_path / "ckpt")
    trainer.save_checkpoint(path, extra=2)
    train(net, trainer, batches[2:])
    resumed, _ = pair()
    resumed_trainer = DistributedTrainer(resumed.collect_params(), "adam", {"learning_rate": 0.05})
    assert resumed_trainer.load_checkpoint(path) == 2
    train(resumed, resumed_trainer, batches[2:])
    np.testing.assert_array_equal(full(resumed.embed.weight), full(net.embed.weight))


def test_a_stale_row_sparse_gradient_raises_or_is_skipped_like_a_dense_one():
    net, _ = pair()
    trainer = DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
    train(net, trainer, id_batches(steps=1))
    before = full(net.embed.weight)
    with autograd.record():
        loss = net.out(mx.nd.ones((2, DIM))).sum()  # the embedding is not used
    loss.backward()
    with pytest.raises(UserWarning, match=net.embed.weight.name):
        trainer.step(2)
    trainer.step(2, ignore_stale_grad=True)
    np.testing.assert_array_equal(full(net.embed.weight), before)


def test_a_row_sparse_weight_of_unknown_shape_is_refused_with_its_name():
    weight = gluon.Parameter("late_weight", shape=(0, DIM), stype="row_sparse",
                             grad_stype="row_sparse", allow_deferred_init=True)
    weight.initialize()
    with pytest.raises(ValueError, match=r"'late_weight'.*shape is not known yet"):
        DistributedTrainer([weight], "sgd")
