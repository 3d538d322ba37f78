"""Train a small convolutional net on scikit-learn's 8x8 handwritten digits with PyTorch.

torch_digits.py is torch_digits_single.py, a plain PyTorch script, plus the lines that
Horovod's documentation asks for: hvd.init, a rank-strided shard of the training set per
rank, DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state, and printing on
rank 0 only. Run it with hvdrun -np 2 python examples/torch_digits.py. The data ships with
scikit-learn, so nothing is downloaded. Per epoch, it prints the loss and accuracy on the
full training and test sets and the throughput.
"""
import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def make_net():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def evaluate(net, x, y):
    """Mean loss and accuracy of ``net`` on the whole of ``x``, ``y``."""
    with torch.no_grad():
        out = net(x)
        loss = torch.nn.functional.cross_entropy(out, y).item()
        return loss, (out.argmax(1) == y).double().mean().item()


def report(epoch, net, data, seconds, start):
    """Print the epoch's loss and accuracy on the full training and test sets."""
    x_train, y_train, x_test, y_test = data
    train_loss, train_acc = evaluate(net, x_train, y_train)
    _, test_acc = evaluate(net, x_test, y_test)
    print(f"epoch {epoch:2d}  loss {train_loss:.4f}  train acc {train_acc:.4f}  "
          f"test acc {test_acc:.4f}  {len(x_train) / seconds:7.0f} samples/s  "
          f"({time.time() - start:.1f} s)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process and step")
    parser.add_argument("--lr", type=float, default=0.004,
                        help="Adam learning rate of epoch 1; each epoch multiplies it by 0.9")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and shuffling (the test split is fixed)")
    args = parser.parse_args()
    train(args.epochs, args.batch_size, args.lr, args.seed)


def train(epochs=25, batch_size=32, lr=0.004, seed=0):
    """Train for ``epochs``; return the final test accuracy (torch_digits_spark.py and
    torch_digits_ray.py call the distributed version)."""
    torch.set_num_threads(1)

    digits = load_digits()
    images = torch.from_numpy((digits.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8))
    x_train, x_test, y_train, y_test = train_test_split(
        images, torch.from_numpy(digits.target), test_size=0.25, random_state=0,
        stratify=digits.target)
    x_mine, y_mine = x_train, y_train

    torch.manual_seed(seed)
    net = make_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)

    rng = np.random.RandomState(seed)
    start = time.time()
    for epoch in range(1, epochs + 1):
        tic = time.time()
        order = torch.from_numpy(rng.permutation(len(x_mine)))
        for i in range(0, len(order), batch_size):
            batch = order[i:i + batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x_mine[batch]), y_mine[batch])
            loss.backward()
            optimizer.step()
        scheduler.step()
        report(epoch, net, (x_train, y_train, x_test, y_test), time.time() - tic, start)
    return evaluate(net, x_test, y_test)[1]


if __name__ == "__main__":
    main()
