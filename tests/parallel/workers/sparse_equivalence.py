"""Row-sparse gradients: N ranks with DistributedTrainer == one process on the global batch.

The model is a bag of words, Embedding(sparse_grad=True) -> sum over tokens -> Dense, so
every case mixes a row-sparse and two dense gradients. Every rank draws the same global token
batches; row 7 is in every sample (a duplicate within and across ranks). In ``skip`` steps the
last rank does not use the embedding (it touches no rows), which the reference mirrors by
running each rank's block through the same function. Each case also checks which way the rows
travelled (allgather or dense allreduce), on every rank.
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvd_trainer
from case_runner import run_cases
from trainer_common import close, same_on_all_ranks, seed_per_rank

STEPS, PER_RANK, TOKENS, DIM, CLASSES, SHARED_ROW = 3, 4, 5, 3, 2, 7
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


class BagOfWords(gluon.Block):
    """Sum of token embeddings -> Dense; ``skip`` feeds the Dense layer without the embedding."""

    def __init__(self, vocab: int):
        super().__init__()
        with self.name_scope():
            self.embed = gluon.nn.Embedding(vocab, DIM, sparse_grad=True)
            self.out = gluon.nn.Dense(CLASSES, in_units=DIM)

    def forward(self, tokens, skip=False):
        hidden = tokens.slice_axis(1, 0, DIM) / 10 if skip else self.embed(tokens).sum(axis=1)
        return self.out(hidden)


def batches(vocab: int, high: int, all_rows_at_0: bool, seed: int):
    """Global (tokens, labels) batches; tokens below ``high``; step 0 may cover every row."""
    rng = np.random.RandomState(seed)
    size = hvd_trainer.size()
    out = []
    for step in range(STEPS):
        tokens = rng.randint(0, high, (size * PER_RANK, TOKENS))
        tokens[:, 0] = SHARED_ROW
        if all_rows_at_0 and step == 0:
            flat = tokens.reshape(size, -1)
            flat[:, :vocab] = np.arange(vocab)
        out.append((tokens.astype(np.float32),
                    rng.randint(0, CLASSES, size * PER_RANK).astype(np.float32)))
    return out


def forward_backward(net, blocks, ctxs):
    """Forward each (tokens, labels, skip) block split over ``ctxs``; backward the sum."""
    with autograd.record():
        losses = []
        for tokens, labels, skip in blocks:
            for t, y, c in zip(np.array_split(tokens, len(ctxs)),
                               np.array_split(labels, len(ctxs)), ctxs):
                losses.append(loss_fn(net(mx.nd.array(t, ctx=c), skip), mx.nd.array(y, ctx=c)))
    autograd.backward(losses)


def weights(net):
    return [p.list_data()[0].asnumpy() for p in net.collect_params().values()]


CASES = [
    # name, vocab, token range, optimizer, params, options
    ("sgd lazy, momentum, wd; last rank idle at step 1", 100, 30, "sgd",
     {"learning_rate": 0.5, "momentum": 0.9, "wd": 0.01}, dict(skip_step=1)),
    ("sgd not lazy, momentum, wd, gradient_predivide_factor=2", 100, 30, "sgd",
     {"learning_rate": 0.5, "momentum": 0.9, "wd": 0.01, "lazy_update": False},
     dict(kwargs={"gradient_predivide_factor": 2.0})),
    ("adam lazy; last rank idle at step 2", 100, 30, "adam",
     {"learning_rate": 0.05}, dict(skip_step=2)),
    ("adam not lazy", 100, 30, "adam", {"learning_rate": 0.05, "lazy_update": False}, {}),
    ("all rows touched at step 0, then rows 0..5 of 8: dense fallback, sgd lazy wd", 8, 6,
     "sgd", {"learning_rate": 0.5, "momentum": 0.9, "wd": 0.01},
     dict(all_rows=True, dense=True)),
    ("sparse_as_dense=True, adam lazy", 100, 30, "adam", {"learning_rate": 0.05},
     dict(dense=True, kwargs={"sparse_as_dense": True})),
    ("two contexts per process, fp16 compression of the dense gradients", 100, 30, "sgd",
     {"learning_rate": 0.5, "momentum": 0.9}, dict(ctxs=[mx.cpu(0), mx.cpu(1)],
                                                  kwargs={"compression_params": {"type": "fp16"}},
                                                  tol=2e-3)),
]


def run_case(index, name, vocab, high, optimizer, opt_params, skip_step=None, all_rows=False,
             dense=False, ctxs=(mx.cpu(),), kwargs=None, tol=1e-5):
    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    data = batches(vocab, high, all_rows, seed=index)
    seed_per_rank()
    net = BagOfWords(vocab)
    net.initialize(mx.init.Xavier(), ctx=list(ctxs))
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), optimizer, dict(opt_params),
                                             prefix=f"sparse{index}.", **(kwargs or {}))
    start = weights(net)
    paths = []
    for step, (tokens, labels) in enumerate(data):
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        forward_backward(net, [(tokens[mine], labels[mine],
                                step == skip_step and rank == size - 1)], ctxs)
        trainer.step(PER_RANK)
        paths.append(trainer.sparse_exchanges[net.embed.weight.name].dense)
    assert paths == [dense] * STEPS, f"{name}: dense paths per step {paths}, expected {dense}"
    same_on_all_ranks([d.asnumpy() for p in net.collect_params().values() for d in p.list_data()],
                      f"{name}: weights after training")
    if rank == 0:
        ref = BagOfWords(vocab)
        ref.initialize(ctx=mx.cpu())
        for p, value in zip(ref.collect_params().values(), start):
            p.set_data(mx.nd.array(value))
        ref_trainer = gluon.Trainer(ref.collect_params(), optimizer, dict(opt_params))
        for step, (tokens, labels) in enumerate(data):
            blocks = [(tokens[r * PER_RANK:(r + 1) * PER_RANK],
                       labels[r * PER_RANK:(r + 1) * PER_RANK], step == skip_step and r == size - 1)
                      for r in range(size)]
            forward_backward(ref, blocks, [mx.cpu()])
            ref_trainer.step(size * PER_RANK)
        worst = close(weights(net), weights(ref), tol, tol, name)
        print(f"{name}: {'dense' if dense else 'sparse'} path, max |diff| vs single "
              f"process {worst:.2g}", flush=True)


def case(index):
    name, vocab, high, optimizer, opt_params, options = CASES[index]
    return lambda: run_case(index, name, vocab, high, optimizer, opt_params, **options)


def main():
    run_cases({"sgd_lazy_last_rank_idle": case(0), "sgd_not_lazy_predivide": case(1),
               "adam_lazy_last_rank_idle": case(2), "adam_not_lazy": case(3),
               "dense_fallback_sgd_lazy": case(4), "sparse_as_dense_adam": case(5),
               "two_contexts_fp16": case(6)}, rank=hvd_trainer.rank())


if __name__ == "__main__":
    main()
