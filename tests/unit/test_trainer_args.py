"""DistributedTrainer and broadcast_parameters in a one-rank world: argument errors, warnings,
and plain gluon.Trainer behaviour when there is nobody to reduce with."""
import os
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from hvd_trainer.compression import Compression, TopK
from hvd_trainer.mxnet.optimizer import DistributedOptimizer
from hvd_trainer.mxnet.parameters import broadcast_parameters
from hvd_trainer.mxnet.trainer import DistributedTrainer
from hvd_trainer.mxnet.trainer_arguments import TrainerArguments, read_positional


def dense(in_units=3, units=2):
    net = gluon.nn.Dense(units, in_units=in_units)
    net.initialize(mx.init.Xavier())
    return net


def train(net, trainer, ctxs, steps=3):
    rng = np.random.RandomState(0)
    for _ in range(steps):
        x = rng.uniform(size=(4, 3)).astype(np.float32)
        with autograd.record():
            losses = [net(mx.nd.array(part, ctx=c)).sum()
                      for part, c in zip(np.array_split(x, len(ctxs)), ctxs)]
        autograd.backward(losses)
        trainer.step(4)


def test_update_on_kvstore_true_is_refused():
    with pytest.raises(ValueError, match="update_on_kvstore=True"):
        DistributedTrainer(dense().collect_params(), "sgd", update_on_kvstore=True)


def test_row_sparse_weight_with_a_csr_gradient_is_refused_with_its_name_and_the_fix():
    weight = gluon.Parameter("table_weight", shape=(5, 2), stype="row_sparse", grad_stype="csr")
    weight.initialize()
    with pytest.raises(ValueError, match=r"'table_weight'.*'csr' gradient.*"
                                         r"grad_stype='row_sparse'.*or 'default'"):
        DistributedTrainer({"table": weight}, "sgd")


def test_csr_weight_is_refused_with_its_name():
    weight = gluon.Parameter("csr_weight", shape=(5, 2), stype="csr", grad_stype="csr")
    weight.initialize()
    with pytest.raises(ValueError, match=r"'csr_weight' has stype='csr'.*'row_sparse'"):
        DistributedTrainer({"table": weight}, "sgd")


def test_non_parameter_is_refused_naming_it():
    params = dict(dense().collect_params())
    params["stray"] = mx.nd.zeros(3)
    with pytest.raises(ValueError, match=r"params\['stray'\] is a NDArray"):
        DistributedTrainer(params, "sgd")
    with pytest.raises(ValueError, match=r"params\[1\] is a str"):
        DistributedTrainer([list(params.values())[0], "bias"], "sgd")


@pytest.mark.parametrize("kvstore", ["dist_sync", "local"])
def test_other_kvstore_warns_once(kvstore):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedTrainer(dense().collect_params(), "sgd", kvstore=kvstore)
    assert len(caught) == 1 and "allreduce" in str(caught[0].message)


@pytest.mark.parametrize("kvstore", ["device", None])
def test_default_kvstore_is_silent(kvstore):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedTrainer(dense().collect_params(), "sgd", kvstore=kvstore)
    assert not caught


def test_compression_params():
    trainer = DistributedTrainer(dense().collect_params(), "sgd",
                                 compression_params={"type": "fp16"})
    assert trainer._compression is Compression.fp16
    with pytest.raises(ValueError, match="'3bit' is unknown; valid types: 'fp16', '2bit'"):
        DistributedTrainer(dense().collect_params(), "sgd",
                           compression_params={"type": "3bit", "threshold": 0.5})
    with pytest.raises(ValueError, match="either compression= or compression_params="):
        DistributedTrainer(dense().collect_params(), "sgd", compression=Compression.fp16,
                           compression_params={"type": "fp16"})


def settings(trainer):
    return trainer._compression, trainer._reducer.predivide, trainer._prefix


def test_fourth_positional_is_horovod_s_compression_or_gluon_s_kvstore():
    params = dense().collect_params()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        horovod = DistributedTrainer(params, "sgd", {}, Compression.fp16)
        horovod_all = DistributedTrainer(params, "sgd", {}, Compression.fp16, 2.0, "h.")
    assert not caught  # no kvstore to ignore
    assert settings(horovod) == (Compression.fp16, 1.0, "")
    assert settings(horovod_all) == settings(DistributedTrainer(
        params, "sgd", {}, compression=Compression.fp16, gradient_predivide_factor=2.0,
        prefix="h."))
    top_k = TopK(0.5)
    assert DistributedTrainer(params, "sgd", {}, top_k)._compression is top_k
    for kvstore in ("local", mx.kv.create("local")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gluon_order = DistributedTrainer(params, "sgd", {}, kvstore, {"type": "fp16"}, False)
        assert "ignores kvstore" in str(caught[0].message)
        assert settings(gluon_order) == (Compression.fp16, 1.0, "")


KEYWORDS = {"compression": Compression.none, "gradient_predivide_factor": 1.0, "prefix": None}


@pytest.mark.parametrize("positional, keywords, expected", [
    # gluon's order passes through as given
    (("local", {"type": "fp16"}, False), {}, TrainerArguments(
        "local", {"type": "fp16"}, False, Compression.none, 1.0, None)),
    ((None, None, None), {"prefix": "k."}, TrainerArguments(
        None, None, None, Compression.none, 1.0, "k.")),
    # horovod.mxnet's order: compression, predivide factor, prefix
    ((Compression.fp16, 2, "h."), {}, TrainerArguments(
        "device", None, None, Compression.fp16, 2.0, "h.")),
    ((Compression.fp16, None, None), {"gradient_predivide_factor": 3.0}, TrainerArguments(
        "device", None, None, Compression.fp16, 3.0, None)),
    # a 5th that is not a number stays compression_params (a bool is not a factor)
    ((Compression.fp16, True, None), {}, TrainerArguments(
        "device", True, None, Compression.fp16, 1.0, None)),
])
def test_the_positional_arguments_are_read_by_their_meaning(positional, keywords, expected):
    assert read_positional(*positional, **dict(KEYWORDS, **keywords)) == expected


@pytest.mark.parametrize("args, kwargs, message", [
    ((0.5,), {}, r"4th argument is 0.5: give gluon.Trainer's kvstore .* or horovod.mxnet's "
                 r"compression"),
    ((Compression.fp16,), {"compression": Compression.fp16}, "got compression twice"),
    ((Compression.fp16, 2.0), {"gradient_predivide_factor": 3.0},
     "got gradient_predivide_factor twice"),
    ((Compression.fp16, 2.0, "a."), {"prefix": "b."}, "got prefix twice"),
])
def test_fourth_positional_that_is_neither_or_given_twice_is_refused(args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        DistributedTrainer(dense().collect_params(), "sgd", {}, *args, **kwargs)


def test_broadcast_parameters_names_a_bad_value():
    with pytest.raises(ValueError, match=r"params\['w'\] is a list"):
        broadcast_parameters({"w": [1.0]})
    with pytest.raises(ValueError, match="params is a list"):
        broadcast_parameters([mx.nd.zeros(2)])


@pytest.mark.parametrize("ctxs,predivide", [([mx.cpu(0)], 1.0), ([mx.cpu(0)], 4.0),
                                            ([mx.cpu(0), mx.cpu(1)], 1.0)])
def test_one_rank_matches_gluon_trainer(ctxs, predivide):
    nets = [dense(), dense()]
    nets[0].initialize(ctx=ctxs, force_reinit=True)
    nets[1].initialize(ctx=[mx.cpu()], force_reinit=True)
    nets[1].weight.set_data(nets[0].weight.data(ctxs[0]))
    opt = {"learning_rate": 0.1, "momentum": 0.9}
    train(nets[0], DistributedTrainer(nets[0].collect_params(), "sgd", dict(opt),
                                      gradient_predivide_factor=predivide), ctxs)
    train(nets[1], gluon.Trainer(nets[1].collect_params(), "sgd", dict(opt)), [mx.cpu()])
    for ctx in ctxs:
        np.testing.assert_allclose(nets[0].weight.data(ctx).asnumpy(),
                                   nets[1].weight.data().asnumpy(), rtol=1e-6, atol=1e-7)


def test_save_and_load_states_round_trip(tmp_path):
    net = dense()
    trainer = DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01})
    train(net, trainer, [mx.cpu()], steps=2)
    fname = str(tmp_path / "states")
    trainer.save_states(fname)
    assert os.listdir(tmp_path) == ["states"]
    other = DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01})
    other.load_states(fname)
    for (a_mean, a_var), (b_mean, b_var) in zip(trainer._updaters[0].states.values(),
                                                other._updaters[0].states.values()):
        np.testing.assert_array_equal(a_mean.asnumpy(), b_mean.asnumpy())
        np.testing.assert_array_equal(a_var.asnumpy(), b_var.asnumpy())
    with pytest.raises(FileNotFoundError, match="missing"):
        other.load_states(str(tmp_path / "missing"))


def test_distributed_optimizer_is_unwrapped_once():
    inner = mx.optimizer.SGD(learning_rate=0.1, rescale_grad=0.5)
    wrapped = DistributedOptimizer(inner, gradient_predivide_factor=2.0)
    with pytest.warns(UserWarning, match="DistributedOptimizer"):
        trainer = DistributedTrainer(dense().collect_params(), wrapped)
    assert trainer.optimizer is inner
    assert trainer._scale == 0.5  # the per-rank value, not the wrapper's predivided one
