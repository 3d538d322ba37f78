"""Train a small convolutional net on scikit-learn's 8x8 handwritten digits with Gluon.

gluon_digits.py (hvd_trainer.DistributedTrainer) and gluon_digits_single.py (gluon.Trainer)
differ only in that line and its import. Run either as a plain script, or on several
processes (hvdrun -np 2 python examples/gluon_digits.py): each process then trains on its
own rank-strided shard of the training set, and the distributed trainer sums the gradients.
The data ships with scikit-learn, so nothing is downloaded. Rank 0 prints, per epoch, the
loss and accuracy on the full training and test sets and the whole job's throughput;
with --compression, DistributedTrainer's bytes sent per step and its encode/decode time too.
"""
import argparse
import json
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def launcher_rank_and_size():
    """This process's rank and the number of processes, as the MPI launcher (hvdrun, mpiexec,
    srun) exports them; rank 0 of 1 for a plain run."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def compression_params(spec):
    """'topk,ratio=0.01' -> {'type': 'topk', 'ratio': 0.01}; 'none' -> None."""
    kind, *options = spec.split(",")
    if kind == "none":
        return None
    return {"type": kind, **{k: json.loads(v) for k, v in (o.split("=", 1) for o in options)}}


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Flatten(),
            gluon.nn.Dense(64, activation="relu"),
            gluon.nn.Dense(10))
    return net


def evaluate(net, x, y, loss_fn):
    """Mean loss and accuracy of ``net`` on the whole of ``x``, ``y``."""
    out = net(mx.nd.array(x))
    loss = loss_fn(out, mx.nd.array(y)).mean().asscalar()
    return loss, float((out.argmax(axis=1).asnumpy() == y).mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process and step")
    parser.add_argument("--lr", type=float, default=0.004,
                        help="Adam learning rate of epoch 1; each epoch multiplies it by 0.9")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and shuffling (the test split is fixed)")
    parser.add_argument("--compression", default="none",
                        help="the trainer's compression_params as type[,key=value...]: fp16, "
                             "2bit,threshold=0.05, scaled_2bit, topk,ratio=0.01, 1bit or none "
                             "(gluon.Trainer compresses nothing on one device)")
    args = parser.parse_args()
    rank, size = launcher_rank_and_size()

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.float32), test_size=0.25, random_state=0,
        stratify=digits.target)
    x_mine, y_mine = x_train[rank::size], y_train[rank::size]

    mx.random.seed(args.seed)
    net = make_net()
    net.initialize(mx.init.Xavier(magnitude=2))
    net.hybridize()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    optimizer_params = {"learning_rate": args.lr}
    trainer = gluon.Trainer(
        net.collect_params(), "adam", optimizer_params,
        compression_params=compression_params(args.compression))

    rng = np.random.RandomState(args.seed + rank)
    start = time.time()
    for epoch in range(1, args.epochs + 1):
        tic = time.time()
        trainer.set_learning_rate(args.lr * 0.9 ** (epoch - 1))
        order = rng.permutation(len(x_mine))
        for i in range(0, len(order), args.batch_size):
            batch = order[i:i + args.batch_size]
            data, label = mx.nd.array(x_mine[batch]), mx.nd.array(y_mine[batch])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(batch))
        mx.nd.waitall()
        seconds = time.time() - tic
        if rank == 0:
            train_loss, train_acc = evaluate(net, x_train, y_train, loss_fn)
            _, test_acc = evaluate(net, x_test, y_test, loss_fn)
            print(f"epoch {epoch:2d}  loss {train_loss:.4f}  train acc {train_acc:.4f}  "
                  f"test acc {test_acc:.4f}  {len(x_train) / seconds:7.0f} samples/s  "
                  f"({time.time() - start:.1f} s)", flush=True)
            stats = getattr(trainer, "communication_stats", None)  # DistributedTrainer's
            if stats is not None and args.compression != "none":
                print(f"          last step: sent {stats.bytes_sent / 1e3:.1f} kB "
                      f"(uncompressed {stats.dense_bytes / 1e3:.1f} kB, "
                      f"{stats.dense_bytes / max(stats.bytes_sent, 1):.1f}x less), encode "
                      f"{stats.encode_seconds * 1e3:.2f} ms, decode "
                      f"{stats.decode_seconds * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
