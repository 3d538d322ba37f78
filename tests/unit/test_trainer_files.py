"""The trainer's files in a one-rank world: states and checkpoints written without following
planted symlinks, checkpoints verified before anything is unpickled, and loads of another
model's or kind's file refused, naming what differs."""
import os
import pickle
import socket
import stat

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from hvd_trainer.mxnet.trainer import DistributedTrainer


def trained(units=2, optimizer="adam", steps=2):
    net = gluon.nn.Dense(units, in_units=3)
    net.initialize(mx.init.Xavier())
    trainer = DistributedTrainer(net.collect_params(), optimizer, {"learning_rate": 0.01})
    x = mx.nd.array(np.random.RandomState(0).uniform(size=(4, 3)))
    for _ in range(steps):
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(4)
    return net, trainer


class _Planted:
    """A pickle that creates a file when it is loaded: proof that code from a file ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("save", ["save_states", "save_checkpoint"])
def test_saving_never_writes_through_a_planted_symlink(tmp_path, save):
    _, trainer = trained()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    fname = tmp_path / "saved"
    # The names a writer could be tricked with: the file's own and the predictable
    # temporary name that earlier versions used.
    (tmp_path / f"saved.tmp.{socket.gethostname()}.{os.getpid()}").symlink_to(victim)
    fname.symlink_to(victim)
    getattr(trainer, save)(str(fname))
    assert victim.read_bytes() == b"precious"
    assert not fname.is_symlink() and stat.S_IMODE(fname.stat().st_mode) == 0o600


def test_a_pickle_posing_as_a_checkpoint_is_refused_before_it_is_unpickled(tmp_path):
    _, trainer = trained()
    fname = tmp_path / "evil.checkpoint"
    marker = tmp_path / "code ran"
    fname.write_bytes(pickle.dumps(_Planted(str(marker))))
    with pytest.raises(ValueError, match="no checkpoint header"):
        trainer.load_checkpoint(str(fname))
    assert not marker.exists()


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    net, trainer = trained()
    fname = tmp_path / "model.checkpoint"
    trainer.save_checkpoint(str(fname), extra={"epoch": 3})
    whole = fname.read_bytes()
    before = net.weight.data().asnumpy().copy()
    fname.write_bytes(whole[:-10])
    with pytest.raises(ValueError, match="model.checkpoint' is damaged"):
        trainer.load_checkpoint(str(fname))
    flipped = bytearray(whole)
    flipped[-5] ^= 1
    fname.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="is damaged"):
        trainer.load_checkpoint(str(fname))
    np.testing.assert_array_equal(net.weight.data().asnumpy(), before)
    fname.write_bytes(whole)
    assert trainer.load_checkpoint(str(fname)) == {"epoch": 3}


def test_load_states_of_a_checkpoint_is_refused_and_keeps_the_moments(tmp_path):
    _, trainer = trained()
    moments = {i: [a.asnumpy().copy() for a in state]
               for i, state in trainer._updaters[0].states.items()}
    fname = str(tmp_path / "model.checkpoint")
    trainer.save_checkpoint(fname)
    with pytest.raises(ValueError, match="is a checkpoint written by save_checkpoint"):
        trainer.load_states(fname)
    for i, state in trainer._updaters[0].states.items():
        for kept, array in zip(moments[i], state):
            np.testing.assert_array_equal(array.asnumpy(), kept)


@pytest.mark.parametrize("other, message", [
    # Gluon's order is the sorted names: the bias is parameter 0.
    (dict(units=4), "the state of parameter 0 \\('.*bias'\\) has shape \\(4,\\), the parameter \\(2,\\)"),
    (dict(optimizer="sgd"), "holds states of optimizer SGD, this trainer's is Adam"),
])
def test_load_states_of_another_model_or_optimizer_names_what_differs(tmp_path, other, message):
    _, source = trained(**other)
    fname = str(tmp_path / "states")
    source.save_states(fname)
    _, trainer = trained()
    with pytest.raises(ValueError, match=message):
        trainer.load_states(fname)


def test_load_states_of_a_model_with_more_parameters_names_the_counts(tmp_path):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(2, in_units=3), gluon.nn.Dense(2, in_units=2))
    net.initialize()
    source = DistributedTrainer(net.collect_params(), "adam")
    with autograd.record():
        loss = net(mx.nd.ones((1, 3))).sum()
    loss.backward()
    source.step(1)
    fname = str(tmp_path / "states")
    source.save_states(fname)
    _, trainer = trained()
    with pytest.raises(ValueError, match="holds states of 4 parameters, up to index 3; this "
                                         "trainer has 2 parameters"):
        trainer.load_states(fname)


def test_a_device_is_refused_by_its_header_without_reading_on(tmp_path):
    _, trainer = trained()
    with pytest.raises(ValueError, match="'/dev/zero' is not a DistributedTrainer checkpoint"):
        trainer.load_checkpoint("/dev/zero")
    with pytest.raises(ValueError, match="'/dev/zero' is not a regular file"):
        trainer.load_states("/dev/zero")


@pytest.mark.parametrize("cut", [5, 23, 24])
def test_a_checkpoint_cut_inside_its_header_is_called_truncated(tmp_path, cut):
    _, trainer = trained()
    fname = tmp_path / "model.checkpoint"
    trainer.save_checkpoint(str(fname))
    fname.write_bytes(fname.read_bytes()[:cut])
    with pytest.raises(ValueError, match=f"truncated checkpoint: it ends inside its header "
                                         f"\\({cut} bytes\\)"):
        trainer.load_checkpoint(str(fname))


class _Unpicklable:
    def __reduce__(self):
        raise KeyError("not today")


def test_an_extra_that_cannot_be_pickled_or_unpickled_is_a_value_error(tmp_path):
    _, trainer = trained()
    fname = tmp_path / "model.checkpoint"
    with pytest.raises(ValueError, match="cannot be pickled .*KeyError"):
        trainer.save_checkpoint(str(fname), extra=_Unpicklable())
    (tmp_path / "made").write_bytes(b"")  # unpickling calls os.mkdir on it, which fails
    trainer.save_checkpoint(str(fname), extra=_Planted(str(tmp_path / "made")))
    with pytest.raises(ValueError, match="cannot be unpickled here .*FileExistsError"):
        trainer.load_checkpoint(str(fname))
