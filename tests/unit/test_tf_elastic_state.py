"""hvd_trainer.tensorflow's elastic states in a one-process world: TensorFlowKerasState's and
TensorFlowState's commit and restore against the values saved by hand (an optimizer built
only after the commit included), and horovod.keras's elastic callbacks in a model.fit against
the batches and epochs Keras reports."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import hvd_trainer.tensorflow as hvd
import hvd_trainer.tensorflow.keras as hvd_keras


@pytest.fixture(autouse=True, scope="module")
def world():
    hvd.init()


def model_and_optimizer():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    return model, keras.optimizers.SGD(0.1, momentum=0.9)


def step(model, optimizer):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones([4, 3])))
    optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)


def values(variables):
    return [tf.convert_to_tensor(v).numpy() for v in variables]


def test_keras_state_restores_weights_momentum_and_attributes():
    model, optimizer = model_and_optimizer()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=3)
    step(model, optimizer)
    state.commit()
    weights, moments = values(model.variables), values(optimizer.variables)
    step(model, optimizer)
    state.epoch = 4
    state.restore()
    for got, want in zip(values(model.variables) + values(optimizer.variables),
                         weights + moments):
        np.testing.assert_array_equal(got, want)
    assert state.epoch == 3 and int(optimizer.iterations.numpy()) == 1


def test_a_fresh_process_restores_a_commit_made_after_the_first_step():
    model, optimizer = model_and_optimizer()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer)
    step(model, optimizer)
    state.commit()
    fresh_model, fresh_optimizer = model_and_optimizer()  # its optimizer has no variables yet
    fresh = hvd.elastic.TensorFlowKerasState(fresh_model, fresh_optimizer)
    fresh._committed = state._committed  # what run() hands a new life from the disk
    fresh.restore()
    for got, want in zip(values(fresh_model.variables) + values(fresh_optimizer.variables),
                         values(model.variables) + values(optimizer.variables)):
        np.testing.assert_array_equal(got, want)


def test_keras_state_refuses_an_unbuilt_model_and_a_mismatched_commit():
    with pytest.raises(ValueError, match="model.build"):
        hvd.elastic.TensorFlowKerasState(keras.Sequential([keras.layers.Dense(2)]))
    model, optimizer = model_and_optimizer()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer)
    state.commit()
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    wrong = hvd.elastic.TensorFlowKerasState(other)
    wrong._committed = state._committed
    with pytest.raises(ValueError, match="holds 2 variables, this process has 4"):
        wrong.restore()


def test_tensorflow_state_restores_variables():
    v = tf.Variable([1.0, 2.0])
    state = hvd.elastic.TensorFlowState([v], batch=5)
    state.commit()
    v.assign([7.0, 8.0])
    state.batch = 6
    state.restore()
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert state.batch == 5
    with pytest.raises(ValueError, match="pass variables="):
        hvd.elastic.TensorFlowState()


def test_keras_elastic_callbacks_track_batches_and_epochs_and_commit():
    model, optimizer = model_and_optimizer()
    model.compile(optimizer=optimizer, loss="mse")
    state = hvd_keras.elastic.KerasState(model, batch=0, epoch=2)
    commits = []
    state.commit = lambda: commits.append((state.epoch, state.batch))
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append((state.epoch, state.batch)))
    callbacks = [hvd_keras.elastic.UpdateBatchStateCallback(state),
                 hvd_keras.elastic.UpdateEpochStateCallback(state),
                 hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=2), record]
    model.fit(np.ones((6, 3)), np.zeros((6, 2)), batch_size=2, epochs=2, verbose=0,
              callbacks=callbacks)
    # 3 batches per epoch: state.batch is the last finished batch, 0 again at an epoch's end;
    # the epoch counts on from 2; a commit after every 2nd batch and at each epoch's end.
    assert seen == [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)]
    assert state.epoch == 4 and state.batch == 0
    assert commits == [(2, 1), (3, 0), (3, 0), (3, 2), (4, 0)]
