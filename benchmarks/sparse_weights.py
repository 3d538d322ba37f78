"""row_sparse weights: a 1M-row SparseEmbedding against a dense embedding, 2 ranks.

Run:  OMP_NUM_THREADS=1 hvdrun -np 2 --no-prefix python benchmarks/sparse_weights.py
A 1,000,000 x 16 float32 embedding (64 MB) feeds Dense(1) through the mean of each sample's
ids; Adam, DistributedTrainer. Every rank draws its own random ids each step (256 samples of
20 ids, about 0.5% of the rows per rank). Variants:

- row_sparse weight: ``contrib.nn.SparseEmbedding``, rows served by the trainer, gradient
  rows gathered, lazy update of the touched rows;
- dense weight, ``Embedding(sparse_grad=True)``: the sparse gradient path with a dense weight;
- dense weight, dense gradient (``Embedding``): the whole table is allreduced and updated.

Each variant trains the same steps; repetitions alternate between variants (median kept,
each timed on the slower rank), so the ratios compare like with like on a shared machine.
Bytes are the embedding gradient's, per rank and step: "payload" is what the trainer's rule
compares (gathered ids and rows, or the dense table), "received" what the wire brings one
rank (the other ranks' ids and rows, or the ring allreduce's 2(N-1)/N of the table).
"""
import argparse
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon.contrib.nn import SparseEmbedding

import hvd_trainer
from common import header, seconds_per_step

ROWS, DIM, BATCH, IDS = 1_000_000, 16, 256, 20


class Model(gluon.Block):
    """mean of the ids' embeddings -> Dense(1), with a row_sparse or a dense embedding."""

    def __init__(self, embedding: gluon.Block):
        super().__init__()
        with self.name_scope():
            self.embed = embedding
            self.out = gluon.nn.Dense(1, in_units=DIM)

    def forward(self, ids):
        return self.out(self.embed(ids).mean(axis=1))


VARIANTS = [
    ("row_sparse weight (SparseEmbedding)", lambda: SparseEmbedding(ROWS, DIM)),
    ("dense weight, Embedding(sparse_grad=True)",
     lambda: gluon.nn.Embedding(ROWS, DIM, sparse_grad=True)),
    ("dense weight, dense gradient (Embedding)", lambda: gluon.nn.Embedding(ROWS, DIM)),
]


class Variant:
    """A net and its trainer, and a stream of random id batches of this rank's own."""

    def __init__(self, number: int, label: str, make_embedding):
        self.label = label
        mx.random.seed(0)
        self.net = Model(make_embedding())
        self.net.initialize(mx.init.Normal(0.01))
        self.trainer = hvd_trainer.DistributedTrainer(
            self.net.collect_params(), "adam", {"learning_rate": 0.001}, prefix=f"v{number}.")
        self.rng = np.random.RandomState(100 + hvd_trainer.rank())
        self.ids = np.zeros(0)
        self.times = []

    def step(self) -> None:
        self.ids = self.rng.randint(0, ROWS, (BATCH, IDS))
        with autograd.record():
            loss = self.net(mx.nd.array(self.ids)).sum()
        loss.backward()
        self.trainer.step(BATCH)

    def traffic(self, size: int):
        """(payload, received) bytes of the embedding gradient at the last step."""
        table = ROWS * DIM * 4
        exchange = self.trainer.sparse_exchanges.get(self.net.embed.weight.name)
        if exchange is None:  # a dense gradient: one ring allreduce of the table
            return table, 2 * (size - 1) / size * table
        others = exchange.gathered_rows - self.own_rows()
        received = others * 8 + (2 * (size - 1) / size * table if exchange.dense
                                 else others * DIM * 4)
        return exchange.bytes, received

    def own_rows(self) -> int:
        """Distinct rows this rank's last batch touched."""
        return np.unique(self.ids).size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per timed repetition")
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    hvd_trainer.init()
    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    variants = [Variant(n, label, make) for n, (label, make) in enumerate(VARIANTS)]
    for v in variants:
        v.step()  # warm-up: optimizer states, first allocations
        v.times = []
    for _ in range(args.repetitions):
        for v in variants:
            v.times.append(seconds_per_step(v.step, args.steps, 1, 0, size > 1))
    if rank != 0:
        return
    print(header(f"row_sparse weights, {ROWS} x {DIM} float32 embedding + Dense(1), Adam, "
                 f"{size} ranks, {BATCH} x {IDS} random ids per rank and step",
                 f"load average {os.getloadavg()[0]:.1f}, OMP_NUM_THREADS="
                 f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, median of {args.repetitions} x "
                 f"{args.steps} steps"), flush=True)
    print("| variant | payload MB | received MB | ms/step |\n|---|---|---|---|")
    rows = []
    for v in variants:
        payload, received = v.traffic(size)
        step = float(np.median(v.times)) * 1e3
        rows.append((payload, step))
        print(f"| {v.label} | {payload / 1e6:.2f} | {received / 1e6:.2f} | {step:.1f} |")
    (sparse_bytes, sparse_ms), (dense_bytes, dense_ms) = rows[0], rows[-1]
    print(f"row_sparse weight vs dense: {dense_ms / sparse_ms:.1f}x faster per step, "
          f"1/{dense_bytes / sparse_bytes:.0f} of the bytes ({variants[0].own_rows()} rows "
          "touched on rank 0)", flush=True)


if __name__ == "__main__":
    main()
