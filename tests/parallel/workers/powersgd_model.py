"""A NumPy model of PowerSGD written from the paper (Vogels et al., 2019) and DDP's documented
``powerSGD_hook`` behaviour, independent of hvd_trainer.collectives.powersgd, for the tests to replay a
job in one process: per tensor, every rank's input (gradient plus its residual) times the
shared Q, summed; Gram-Schmidt in float64; the new Q summed; the sum approximated by P·Qᵀ;
each rank's residual its input minus 1/N of that. Tensors of fewer than 2 dimensions, not
float32/64, or whose factors save less than ``min_rate`` times, and every tensor before its
``start_iter``-th reduction, are summed exactly. The first Q is the documented seeded draw:
standard normal from ``numpy.random.default_rng([seed, crc32(repr(key)), draw])``, ``draw``
0 with warm start, else the tensor's reduction count.
"""
import zlib

import numpy as np


def gram_schmidt(p: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning ``p``'s, column by column, in float64."""
    q = np.array(p, np.float64)
    for j in range(q.shape[1]):
        for i in range(j):
            q[:, j] -= (q[:, i] @ q[:, j]) * q[:, i]
        q[:, j] /= np.linalg.norm(q[:, j])
    return q


class PowerSGDModel:
    """Replays PowerSGD for ``ranks`` ranks; :meth:`sum` gives one tensor's reduced sum."""

    def __init__(self, ranks, rank, start_iter, min_rate=2.0, error_feedback=True,
                 warm_start=True, seed=0):
        self.ranks, self.rank, self.start_iter, self.min_rate = ranks, rank, start_iter, min_rate
        self.error_feedback, self.warm_start, self.seed = error_feedback, warm_start, seed
        self.residual, self.q, self.count = {}, {}, {}

    def compressed(self, shape, dtype):
        """(rows, cols, r) when PowerSGD factors a tensor of this shape and dtype, else None."""
        if len(shape) < 2 or np.dtype(dtype) not in (np.float32, np.float64):
            return None
        n, m = shape[0], int(np.prod(shape[1:]))
        r = min(n, m, self.rank)
        return (n, m, r) if (n + m) * r * self.min_rate < n * m else None

    def sum(self, key, grads):
        """The reduced sum of tensor ``key`` given every rank's gradient (rank order)."""
        grads = [np.asarray(g) for g in grads]
        count = self.count.get(key, 0)
        self.count[key] = count + 1
        factored = self.compressed(grads[0].shape, grads[0].dtype)
        if factored is None or count < self.start_iter:
            return sum(g.astype(np.float64) for g in grads)
        n, m, r = factored
        inputs = [g.reshape(n, m).astype(np.float64) + self.residual.get((i, key), 0)
                  for i, g in enumerate(grads)]
        q = self.q.get(key) if self.warm_start else None
        if q is None:
            draw = 0 if self.warm_start else count
            rng = np.random.default_rng([self.seed, zlib.crc32(repr(key).encode()), draw])
            q = rng.standard_normal((m, r)).astype(grads[0].dtype).astype(np.float64)
        p = gram_schmidt(sum(x @ q for x in inputs))
        q = sum(x.T @ p for x in inputs)
        approx = p @ q.T
        if self.error_feedback:
            for i, x in enumerate(inputs):
                self.residual[i, key] = x - approx / self.ranks
        if self.warm_start:
            self.q[key] = q
        return approx.reshape(grads[0].shape)
