"""Sparse gradients: row-sparse allgather vs dense allreduce, bytes and step time, 2 ranks.

Run:  OMP_NUM_THREADS=1 hvdrun -np 2 --no-prefix python benchmarks/sparse.py [--steps 3]
A 200k x 64 float32 embedding (sparse_grad=True) feeds a Dense layer; every rank touches a
fixed number of distinct random rows per step. At each density it times full training steps
(forward, backward, allreduce_grads, update with Adam), and the exchange (allreduce_grads)
alone, of the sparse path (allgather) and of the dense path (sparse_as_dense=True);
repetitions interleaved, the median kept, each timed on the slowest rank. The sparse path is
forced past the automatic switch (hvd_trainer.collectives.sparse.use_dense patched) to measure where
it really stops paying. At 1% it also times a plain dense embedding (sparse_grad=False).

Bytes are per rank and step, for the embedding gradient: "payload" is what the automatic rule
compares (gathered ids + gathered rows, or gathered ids + the dense table); "received" is what
the wire brings each rank (the other ranks' ids and rows, or their ids plus the ring
allreduce's 2(n-1)/n of the table).
"""
import argparse
import datetime
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvd_trainer
from hvd_trainer.collectives import sparse

ROWS, DIM, BATCH = 200_000, 64, 100
DENSITIES = [0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]


class Model(gluon.HybridBlock):
    def __init__(self, sparse_grad: bool):
        super().__init__()
        with self.name_scope():
            self.embed = gluon.nn.Embedding(ROWS, DIM, sparse_grad=sparse_grad)
            self.out = gluon.nn.Dense(1, in_units=DIM)

    def hybrid_forward(self, F, tokens):
        return self.out(F.mean(self.embed(tokens), axis=1))


def token_batches(density: float, count: int, seed: int):
    """``count`` batches of shape (BATCH, k / BATCH), each holding k distinct random rows."""
    rng = np.random.RandomState(seed)
    per = max(1, int(round(density * ROWS / BATCH)))
    return [mx.nd.array(rng.permutation(ROWS)[:BATCH * per].reshape(BATCH, per))
            for _ in range(count)]


class Variant:
    """A net and its trainer; ``step`` runs one timed training step."""

    def __init__(self, name: str, label: str, sparse_grad: bool = True, **kwargs):
        self.name, self.label = name, label
        mx.random.seed(0)
        self.net = Model(sparse_grad)
        self.net.initialize(mx.init.Normal(0.01))
        self.trainer = hvd_trainer.DistributedTrainer(self.net.collect_params(), "adam",
                                                      {"learning_rate": 0.001},
                                                      prefix=f"{name}.", **kwargs)
        self.forced_sparse = name == "sparse"
        self.times = []

    def step(self, tokens) -> float:
        """One training step; returns the seconds its gradient exchange took."""
        original = sparse.use_dense
        if self.forced_sparse:
            sparse.use_dense = lambda gathered_rows, num_rows: False
        try:
            with autograd.record():
                loss = self.net(tokens).sum()
            loss.backward()
            mx.nd.waitall()
            start = time.perf_counter()
            self.trainer.allreduce_grads()
            mx.nd.waitall()
            exchange = time.perf_counter() - start
            self.trainer.update(BATCH)
            mx.nd.waitall()
            return exchange
        finally:
            sparse.use_dense = original

    def exchange(self):
        return self.trainer.sparse_exchanges.get(self.net.embed.weight.name)


def timed(variant: Variant, batches) -> np.ndarray:
    """Seconds per step and per gradient exchange over ``batches``, on the slowest rank."""
    hvd_trainer.barrier()
    start = time.perf_counter()
    exchange = sum(variant.step(tokens) for tokens in batches)
    elapsed = np.array([time.perf_counter() - start, exchange]) / len(batches)
    return hvd_trainer.allreduce(elapsed, op=hvd_trainer.Max)


def traffic(exchange, own_rows: int, size: int):
    """(payload, received) bytes of one rank's embedding gradient; None: a plain dense one."""
    row_bytes, table = DIM * 4, ROWS * DIM * 4
    ring = 2 * (size - 1) / size * table
    if exchange is None:
        return table, ring
    others = exchange.gathered_rows - own_rows
    return exchange.bytes, others * 8 + (ring if exchange.dense else others * row_bytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repetition")
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    hvd_trainer.init()
    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    variants = [Variant("sparse", "allgather"),
                Variant("dense", "sparse_as_dense", sparse_as_dense=True)]
    plain = Variant("plain", "dense embedding (sparse_grad=False)", sparse_grad=False)
    if rank == 0:
        print(f"# sparse gradients, {ROWS} x {DIM} float32 embedding + Dense(1), Adam, {size} "
              f"ranks: {datetime.date.today()}, {os.cpu_count()} cores, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
              f"median of {args.repetitions} x {args.steps} steps", flush=True)
        print("| rows per rank | density | auto picks | path | payload MB | received MB "
              "| exchange ms | ms/step |\n|---|---|---|---|---|---|---|---|", flush=True)
    for number, density in enumerate(DENSITIES):
        batches = token_batches(density, args.steps, seed=100 * number + rank)
        own = batches[0].size
        runs = variants + ([plain] if number == 0 else [])
        for v in runs:
            v.step(batches[0])  # warm-up
            v.times = []
        for _ in range(args.repetitions):
            for v in runs:
                v.times.append(timed(v, batches))
        gathered = variants[0].exchange().gathered_rows
        auto = "dense" if sparse.use_dense(gathered, ROWS) else "sparse"
        for v in runs:
            payload, received = traffic(v.exchange(), own, size)
            step, exchange = np.median(v.times, axis=0) * 1e3
            if rank == 0:
                print(f"| {own} | {density:.0%} | {auto if v is not plain else '-'} | {v.label} | "
                      f"{payload / 1e6:.2f} | {received / 1e6:.2f} | {exchange:.1f} | "
                      f"{step:.1f} |", flush=True)

if __name__ == "__main__":
    main()
