"""Train a rating model with row_sparse weights (SparseEmbedding) on several ranks.

A recommendation model in Gluon's sparse style: user and item factors and biases are
``contrib.nn.SparseEmbedding`` layers, whose weights are row_sparse. Each forward pass asks
the trainer for the rows its batch needs (``row_sparse_data``); each step sends only the
gradient rows the batch touched, and the lazy Adam update changes only those rows.
DistributedTrainer holds every weight whole on every rank, so nothing else changes from a
one-process ``gluon.Trainer`` script. Ratings are generated (nothing is downloaded) from
hidden user and item factors plus noise; popular items are rated more often.

Run ``hvdrun -np 2 python examples/sparse_weights.py``. Rank 0 prints, per epoch, the training
loss, the held-out RMSE next to the RMSE of always predicting the mean rating, and what one
step's gradient rows moved against the size of the tables.
"""
import argparse
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon.contrib.nn import SparseEmbedding

import hvd_trainer

HIDDEN, NOISE = 4, 0.1


def make_ratings(rng: np.random.RandomState, truth, count: int):
    """``count`` (user, item) pairs, item popularity skewed, and their noisy ratings."""
    users_f, items_f, user_b, item_b = truth
    users = rng.randint(0, len(users_f), count)
    items = np.minimum((rng.pareto(1.2, count) * len(items_f) / 20).astype(np.int64),
                       len(items_f) - 1)
    ratings = ((users_f[users] * items_f[items]).sum(axis=1) + user_b[users] + item_b[items]
               + rng.normal(0, NOISE, count))
    return np.stack([users, items], axis=1).astype(np.float32), ratings.astype(np.float32)


class Ratings(gluon.Block):
    """rating = <user factors, item factors> + user bias + item bias + global bias."""

    def __init__(self, users: int, items: int, dim: int):
        super().__init__()
        with self.name_scope():
            self.user = SparseEmbedding(users, dim, weight_initializer=mx.init.Normal(0.1))
            self.item = SparseEmbedding(items, dim, weight_initializer=mx.init.Normal(0.1))
            self.user_bias = SparseEmbedding(users, 1, weight_initializer="zeros")
            self.item_bias = SparseEmbedding(items, 1, weight_initializer="zeros")
            self.bias = self.params.get("bias", shape=(1,), init="zeros")

    def forward(self, pairs):
        user, item = pairs[:, 0], pairs[:, 1]
        return ((self.user(user) * self.item(item)).sum(axis=1)
                + self.user_bias(user).reshape(-1) + self.item_bias(item).reshape(-1)
                + self.bias.data())


def rmse(net, pairs, ratings, batch=4096):
    errors = [net(mx.nd.array(pairs[i:i + batch])).asnumpy() - ratings[i:i + batch]
              for i in range(0, len(pairs), batch)]
    return float(np.sqrt(np.mean(np.concatenate(errors) ** 2)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--items", type=int, default=5_000)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--ratings", type=int, default=100_000, help="training ratings per rank")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512, help="ratings per rank and step")
    args = parser.parse_args()
    hvd_trainer.init()
    rank, size = hvd_trainer.rank(), hvd_trainer.size()

    truth_rng = np.random.RandomState(0)
    truth = (truth_rng.normal(0, 1, (args.users, HIDDEN)) / np.sqrt(HIDDEN),
             truth_rng.normal(0, 1, (args.items, HIDDEN)),
             truth_rng.normal(0, 0.3, args.users), truth_rng.normal(0, 0.3, args.items))
    pairs, ratings = make_ratings(np.random.RandomState(1 + rank), truth, args.ratings)
    test_pairs, test_ratings = make_ratings(np.random.RandomState(10_000), truth, 20_000)

    mx.random.seed(rank)  # different starting weights: the trainer broadcasts rank 0's
    net = Ratings(args.users, args.items, args.dim)
    net.initialize()
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "adam",
                                             {"learning_rate": 0.01})
    if rank == 0:
        print(f"{size} ranks, {args.users} users x {args.items} items, factors of {args.dim}, "
              f"{args.batch_size} ratings per rank and step; predicting the mean rating: "
              f"held-out RMSE {np.std(test_ratings):.3f}", flush=True)
    tables = sum(np.prod(p.shape) * 4 for p in net.collect_params().values())
    for epoch in range(1, args.epochs + 1):
        order = np.random.RandomState(epoch * 100 + rank).permutation(len(pairs))
        total, steps, start = 0.0, 0, time.perf_counter()
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            batch = order[i:i + args.batch_size]
            with autograd.record():
                loss = ((net(mx.nd.array(pairs[batch])) - mx.nd.array(ratings[batch])) ** 2)
            loss.backward()
            trainer.step(args.batch_size)
            total += loss.mean().asscalar()
            steps += 1
        seconds = (time.perf_counter() - start) / steps
        held_out = rmse(net, test_pairs, test_ratings)
        moved = sum(e.bytes for e in trainer.sparse_exchanges.values())
        traffic = (f"gradient rows moved {moved / 1e6:.2f} MB per step (the tables hold "
                   f"{tables / 1e6:.1f} MB)" if size > 1 else "one process: nothing moves")
        if rank == 0:
            print(f"epoch {epoch}: train loss {total / steps:.3f}, held-out RMSE "
                  f"{held_out:.3f}, {seconds * 1e3:.1f} ms/step, {traffic}", flush=True)


if __name__ == "__main__":
    main()
