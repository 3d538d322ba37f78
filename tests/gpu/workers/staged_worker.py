"""Each rank checks the GPU collectives on ranks that share one GPU against NumPy results
computed from every rank's inputs (all ranks draw every rank's data from the same seeds).

With --force-nccl it sets HVD_GPU_COMMUNICATOR=nccl, which must fail with the fix named.
"""
import os
import sys

if "--force-nccl" in sys.argv:
    os.environ["HVD_GPU_COMMUNICATOR"] = "nccl"

import cupy
import numpy as np

import hvd_trainer as hvd
from hvd_trainer import compression, cuda
from hvd_trainer.collectives import feedback
from hvd_trainer.backends.host_staged import HostStagedCommunicator

hvd.init()
rank, size = hvd.rank(), hvd.size()


def data(r: int, shape, dtype="float32") -> np.ndarray:
    return (np.random.default_rng(100 + r).standard_normal(shape) * 10).astype(dtype)


shapes = [(3, 4), (1000,), (1,), (257, 3)]
tensors = [cupy.asarray(data(rank, s)) for s in shapes]
cuda.grouped_allreduce_(tensors, hvd.Average, "avg", prescale_factor=3.0)
assert isinstance(cuda.communicator(), HostStagedCommunicator)
for s, t in zip(shapes, tensors):
    expected = sum(data(r, s) * np.float32(3) for r in range(size)) / size
    np.testing.assert_allclose(t.get(), expected, rtol=1e-5, atol=1e-5)

top = hvd.allreduce(cupy.asarray(data(rank, 10)), hvd.Sum, "top")  # the top-level API
assert isinstance(top, cupy.ndarray)
np.testing.assert_allclose(top.get(), sum(data(r, 10) for r in range(size)), rtol=1e-5)

ints = cuda.allreduce(cupy.asarray(data(rank, 100, "int64")), hvd.Max, "max")
np.testing.assert_array_equal(ints.get(), np.max([data(r, 100, "int64") for r in range(size)], 0))

flags = cuda.allreduce(cupy.asarray(np.arange(6) % size == rank), hvd.Sum, "or")
np.testing.assert_array_equal(flags.get(), np.ones(6, bool))  # each is set on one rank

rows = [r + 1 for r in range(size)]  # rank r contributes r + 1 rows
gathered = cuda.allgather(cupy.asarray(data(rank, (rows[rank], 5))), "gather")
np.testing.assert_array_equal(gathered.get(),
                              np.concatenate([data(r, (rows[r], 5)) for r in range(size)]))

b = cupy.asarray(data(rank, (4, 4)))
cuda.broadcast_(b, size - 1, "bcast")
np.testing.assert_array_equal(b.get(), data(size - 1, (4, 4)))

share = cuda.reducescatter(cupy.asarray(data(rank, (7, 2))), hvd.Sum, "rs")
total = sum(data(r, (7, 2)) for r in range(size))
first = sum(7 // size + (1 if q < 7 % size else 0) for q in range(rank))
mine = 7 // size + (1 if rank < 7 % size else 0)
np.testing.assert_allclose(share.get(), total[first:first + mine], rtol=1e-5)

# 2-bit error feedback: every rank decodes every payload in rank order, so the GPU sum must
# equal the NumPy one bit for bit.
host, device = (feedback.ErrorFeedbackSum(compression.TwoBit(0.5)),
                cuda.DeviceErrorFeedbackSum(compression.TwoBit(0.5)))
for step in range(3):
    grad = data(rank * 10 + step, 4099)
    h, d = [("w", grad.copy())], [("w", cupy.asarray(grad))]
    host.sum_(h, f"h{step}", scale=1 / size)
    device.sum_(d, f"d{step}", scale=1 / size)
    np.testing.assert_array_equal(d[0][1].get(), h[0][1])

print("GPU collectives match NumPy", flush=True)
