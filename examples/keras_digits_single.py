"""Train a small convolutional net on scikit-learn's 8x8 handwritten digits with Keras 3's
model.fit (TensorFlow backend).

keras_digits.py is keras_digits_single.py, a plain Keras script, plus the lines that
Horovod's documentation asks for: hvd.init, a rank-strided shard of the training set per
rank, the learning rate scaled by the number of ranks, DistributedOptimizer, the broadcast,
metric-average and learning-rate warmup callbacks, and printing on rank 0 only. Run it with
hvdrun -np 2 python examples/keras_digits.py. The data ships with scikit-learn, so nothing is
downloaded. Per epoch, fit prints the loss and accuracy; at the end, the script prints the
accuracy on the full training and test sets.
"""
import argparse
import time

import keras
import numpy as np
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
    callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch: lr * 0.9 ** epoch)]
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    verbose = 2

    start = time.time()
    model.fit(x_mine, y_mine, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=verbose)
    if verbose:
        _, train_acc = model.evaluate(x_train, y_train, verbose=0)
        _, test_acc = model.evaluate(x_test, y_test, verbose=0)
        print(f"train acc {train_acc:.4f}  test acc {test_acc:.4f}  "
              f"({time.time() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
