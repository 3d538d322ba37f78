"""Train a small convolutional net on scikit-learn's 8x8 handwritten digits with TensorFlow: a
custom training loop, tf.GradientTape in a tf.function step, a Keras 3 model and optimizer.

tf_digits_tape.py is tf_digits_tape_single.py, a plain TensorFlow script, plus the lines that
Horovod's documentation asks for: hvd.init, a rank-strided shard of the training set per
rank, the learning rate scaled by the number of ranks, the tape wrapped in
DistributedGradientTape, rank 0's variables broadcast before the first step, and printing on
rank 0 only. Run it with hvdrun -np 2 python examples/tf_digits_tape.py. The data
ships with scikit-learn, so nothing is downloaded. Per epoch, it prints the loss and accuracy
on the full training and test sets and the throughput.
"""
import argparse
import time

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def make_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10)])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def report(epoch, model, data, seconds, start):
    """Print the epoch's loss and accuracy on the full training and test sets."""
    x_train, y_train, x_test, y_test = data
    train_out, test_out = model(x_train), model(x_test)
    train_acc = float(np.mean(np.argmax(train_out, 1) == y_train))
    test_acc = float(np.mean(np.argmax(test_out, 1) == y_test))
    print(f"epoch {epoch:2d}  loss {float(LOSS(y_train, train_out)):.4f}  train acc "
          f"{train_acc:.4f}  test acc {test_acc:.4f}  {len(x_train) / seconds:7.0f} samples/s  "
          f"({time.time() - start:.1f} s)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process and step")
    parser.add_argument("--lr", type=float, default=0.004,
                        help="Adam learning rate of epoch 1 for one process; each epoch "
                             "multiplies it by 0.9")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and shuffling (the test split is fixed)")
    args = parser.parse_args()

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    x_mine, y_mine = x_train, y_train

    keras.utils.set_random_seed(args.seed)
    model = make_model()
    lr = args.lr
    optimizer = keras.optimizers.Adam(lr)
    optimizer.build(model.trainable_variables)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    rng = np.random.RandomState(args.seed)
    start = time.time()
    for epoch in range(1, args.epochs + 1):
        tic = time.time()
        optimizer.learning_rate = lr * 0.9 ** (epoch - 1)
        order = rng.permutation(len(x_mine))
        for i in range(0, len(order), args.batch_size):
            batch = order[i:i + args.batch_size]
            train_step(x_mine[batch], y_mine[batch])
        report(epoch, model, (x_train, y_train, x_test, y_test), time.time() - tic, start)


if __name__ == "__main__":
    main()
