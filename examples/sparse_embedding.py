"""Train a bag-of-words sentiment classifier with a 200k-word sparse embedding on several ranks.

The embedding has ``sparse_grad=True``: a step's gradient holds only the rows of the words in
the batch, and DistributedTrainer allgathers those rows instead of allreducing the whole
table. Documents are generated (nothing is downloaded): a few hundred frequent words, a long
tail over the whole vocabulary, and, per class, words that give the label away. Run
``hvdrun -np 2 python examples/sparse_embedding.py``. Rank 0 prints per epoch the loss and
held-out accuracy, then trains a few more steps with ``sparse_as_dense=True`` and prints, for
both paths, the bytes each step's embedding gradient moved (gathered ids, plus the gathered
rows or the dense table) and the time per step.
"""
import argparse
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvd_trainer

COMMON, CUE_WORDS, LENGTH = 500, 2000, 40


def make_documents(rng: np.random.RandomState, count: int, vocab: int):
    """Token ids (count, LENGTH) and 0/1 labels: 70% common words, 25% tail, 5% cues."""
    labels = rng.randint(0, 2, count)
    kind = rng.uniform(size=(count, LENGTH))
    tokens = np.where(kind < 0.7, rng.randint(0, COMMON, (count, LENGTH)),
                      rng.randint(COMMON, vocab, (count, LENGTH)))
    cues = COMMON + labels[:, None] * CUE_WORDS + rng.randint(0, CUE_WORDS, (count, LENGTH))
    tokens = np.where(kind > 0.95, cues, tokens)
    return tokens.astype(np.float32), labels.astype(np.float32)


class BagOfWords(gluon.HybridBlock):
    """Mean of the words' embeddings, then a linear layer."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        with self.name_scope():
            self.embed = gluon.nn.Embedding(vocab, dim, sparse_grad=True)
            self.out = gluon.nn.Dense(2, in_units=dim)

    def hybrid_forward(self, F, tokens):
        return self.out(F.mean(self.embed(tokens), axis=1))


def train_steps(net, trainer, loss_fn, tokens, labels, batch):
    """One pass over the rows in batches; return the mean loss and seconds per step."""
    total, steps, start = 0.0, 0, time.perf_counter()
    for i in range(0, len(tokens) - batch + 1, batch):
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(tokens[i:i + batch])), mx.nd.array(labels[i:i + batch]))
        loss.backward()
        trainer.step(batch)
        total += loss.mean().asscalar()
        steps += 1
    return total / steps, (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--docs", type=int, default=4096, help="training documents per rank")
    parser.add_argument("--batch-size", type=int, default=64, help="documents per rank and step")
    args = parser.parse_args()
    hvd_trainer.init()
    rank, size = hvd_trainer.rank(), hvd_trainer.size()

    tokens, labels = make_documents(np.random.RandomState(1 + rank), args.docs, args.vocab)
    test_tokens, test_labels = make_documents(np.random.RandomState(0), 2000, args.vocab)
    net = BagOfWords(args.vocab, args.dim)
    net.initialize(mx.init.Normal(0.01))
    net.hybridize()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "adam",
                                             {"learning_rate": 0.02})
    name = net.embed.weight.name
    for epoch in range(1, args.epochs + 1):
        loss, sparse_seconds = train_steps(net, trainer, loss_fn, tokens, labels,
                                           args.batch_size)
        accuracy = (net(mx.nd.array(test_tokens)).argmax(axis=1).asnumpy() == test_labels).mean()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss:.3f}, held-out accuracy {accuracy:.3f}, "
                  f"{sparse_seconds * 1e3:.1f} ms/step", flush=True)
    if size == 1:
        print("one process: nothing to exchange; run it with hvdrun -np 2 to compare the "
              "sparse and dense paths", flush=True)
        return
    sparse_exchange = trainer.sparse_exchanges[name]

    dense_trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "adam",
                                                   {"learning_rate": 0.02},
                                                   sparse_as_dense=True, prefix="dense.")
    short = 8 * args.batch_size
    _, dense_seconds = train_steps(net, dense_trainer, loss_fn, tokens[:short], labels[:short],
                                   args.batch_size)
    dense_exchange = dense_trainer.sparse_exchanges[name]
    if rank == 0:
        table = args.vocab * args.dim * 4
        print(f"embedding {args.vocab} x {args.dim} float32 ({table / 1e6:.1f} MB), {size} ranks, "
              f"{args.batch_size} x {LENGTH} words per rank and step", flush=True)
        for path, exchange, seconds in (("sparse", sparse_exchange, sparse_seconds),
                                        ("dense ", dense_exchange, dense_seconds)):
            print(f"{path} path: {exchange.gathered_rows} rows sent, "
                  f"{exchange.bytes / 1e6:.2f} MB per step, {seconds * 1e3:.1f} ms/step",
                  flush=True)


if __name__ == "__main__":
    main()
