"""Each rank checks hvd_trainer.torch's collectives on CUDA tensors, and a DistributedOptimizer
step on CUDA parameters, against NumPy (and a single-process CPU run) computed from every
rank's inputs (all ranks draw every rank's data from the same seeds)."""
import numpy as np
import torch

import hvd_trainer.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
dev = torch.device("cuda", torch.cuda.current_device())


def data(r: int, shape, dtype="float32") -> np.ndarray:
    return (np.random.default_rng(100 + r).standard_normal(shape) * 10).astype(dtype)


def on_gpu(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, device=dev)  # a copy, also of the NumPy data


def check(t: torch.Tensor, expected: np.ndarray, exact: bool = False) -> None:
    assert t.device == dev, t.device
    if exact:
        np.testing.assert_array_equal(t.cpu().numpy(), expected)
    else:
        np.testing.assert_allclose(t.cpu().numpy(), expected, rtol=1e-5, atol=1e-4)


every = [data(r, (6, 5)) for r in range(size)]
x = on_gpu(every[rank])
check(hvd.allreduce(x, op=hvd.Average), sum(every) / size)
check(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), sum(every))
check(hvd.allreduce(x, op=hvd.Max), np.max(every, 0), exact=True)
np.testing.assert_array_equal(x.cpu().numpy(), every[rank])  # out of place: x unchanged
ptr = x.data_ptr()
assert hvd.allreduce_(x, op=hvd.Min) is x and x.data_ptr() == ptr
check(x, np.min(every, 0), exact=True)
half = hvd.allreduce(on_gpu(every[rank].astype(np.float16)), op=hvd.Sum)
np.testing.assert_allclose(half.cpu().numpy(), sum(e.astype(np.float16).astype(np.float32)
                                                   for e in every), rtol=1e-2, atol=0.1)

ints = [on_gpu(data(rank, 50, "int32")), on_gpu(data(rank, (3, 3), "float64"))]
out = hvd.grouped_allreduce(ints, op=hvd.Sum)
check(out[0], sum(data(r, 50, "int32") for r in range(size)), exact=True)
check(out[1], sum(data(r, (3, 3), "float64") for r in range(size)))
assert hvd.grouped_allreduce_(ints, op=hvd.Sum)[0] is ints[0]

# Ordering: the input is produced on a side stream by a long chain of kernels, and the
# collective, called on that stream, must see the finished values.
side = torch.cuda.Stream(dev)
with torch.cuda.stream(side):
    big = torch.full((2048, 2048), 1.0 / 2048, device=dev)
    y = torch.ones(2048, 2048, device=dev)
    for _ in range(20):
        y = big @ y  # stays all ones
    y = y * (rank + 1)
    reduced = hvd.allreduce(y, op=hvd.Sum)
    total = reduced.sum()  # queued after the collective on the same stream
side.synchronize()
expected = sum(r + 1 for r in range(size))
np.testing.assert_allclose(total.item(), expected * 2048 * 2048, rtol=1e-4)

rows = [r + 1 for r in range(size)]
gathered = hvd.allgather(on_gpu(data(rank, (rows[rank], 5))))
check(gathered, np.concatenate([data(r, (rows[r], 5)) for r in range(size)]), exact=True)
pair = hvd.grouped_allgather([on_gpu(data(rank, (2, 3))), on_gpu(data(rank, (rows[rank],), "int64"))])
check(pair[0], np.concatenate([data(r, (2, 3)) for r in range(size)]), exact=True)
check(pair[1], np.concatenate([data(r, (rows[r],), "int64") for r in range(size)]), exact=True)

b = on_gpu(data(rank, (4, 4)))
hvd.broadcast_(b, size - 1)
check(b, data(size - 1, (4, 4)), exact=True)
check(hvd.broadcast(on_gpu(data(rank, 3)), 0), data(0, 3), exact=True)

share = hvd.reducescatter(on_gpu(data(rank, (7, 2))), op=hvd.Sum)
full = sum(data(r, (7, 2)) for r in range(size))
first = sum(7 // size + (1 if q < 7 % size else 0) for q in range(rank))
mine = 7 // size + (1 if rank < 7 % size else 0)
check(share, full[first:first + mine])
shares = hvd.grouped_reducescatter([on_gpu(data(rank, (7, 2)))], op=hvd.Sum)
check(shares[0], full[first:first + mine])

# alltoall: rank r sends (s + 1) rows to rank s, each row holding r * 100 + s.
splits = [s + 1 for s in range(size)]
send = torch.cat([torch.full((s + 1, 2), float(rank * 100 + s)) for s in range(size)]).to(dev)
received, received_splits = hvd.alltoall(send, splits=splits)
check(received, np.concatenate([np.full((rank + 1, 2), r * 100 + rank, np.float32)
                                for r in range(size)]), exact=True)
assert received_splits.tolist() == [rank + 1] * size

# A sparse tensor: rank r has rows r and r + 1 of an 8 x 3 table.
values = torch.from_numpy(data(rank, (2, 3)))
sparse = torch.sparse_coo_tensor(torch.tensor([[rank, rank + 1]]), values, (8, 3),
                                 check_invariants=True).to(dev)
dense = np.zeros((8, 3), np.float32)
for r in range(size):
    dense[r:r + 2] += data(r, (2, 3))
result = hvd.sparse_allreduce_async(sparse, "sparse", hvd.Sum)()
assert result.is_sparse and result.device == dev
check(result.to_dense(), dense)

# Gradients through the autograd function: Sum's backward sums the incoming gradients.
leaf = on_gpu(every[rank]).requires_grad_()
hvd.allreduce(leaf, op=hvd.Sum).sum().backward()
check(leaf.grad, np.full((6, 5), size, np.float32), exact=True)

# bfloat16 on the GPU is refused on every rank.
try:
    hvd.allreduce(torch.zeros(2, dtype=torch.bfloat16, device=dev))
    raise AssertionError("a bfloat16 CUDA tensor was taken")
except TypeError as e:
    assert "bfloat16" in str(e)

# A DistributedOptimizer step on CUDA parameters (several buckets, a 0-d parameter) equals
# one process stepping on the global batch, on the CPU.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
gain = torch.nn.Parameter(torch.tensor(1.5))
reference = [p.detach().clone() for p in list(model.parameters()) + [gain]]
ref_model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
ref_gain = torch.nn.Parameter(torch.tensor(0.0))
with torch.no_grad():
    for p, q in zip(list(ref_model.parameters()) + [ref_gain], reference):
        p.copy_(q)
model.to(dev)
gain = torch.nn.Parameter(gain.detach().to(dev))
named = [(f"m.{n}", p) for n, p in model.named_parameters()] + [("gain", gain)]
opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9),
                               named)
ref_opt = torch.optim.SGD(list(ref_model.parameters()) + [ref_gain], lr=0.1, momentum=0.9)


def batch(r: int, step: int):
    return torch.from_numpy(data(10 * r + step, (8, 5))), torch.from_numpy(data(50 + r + step, (8, 1)))


for step in range(3):
    inputs, targets = batch(rank, step)
    opt.zero_grad()
    loss = ((gain * model(inputs.to(dev)) - targets.to(dev)) ** 2).mean()
    loss.backward()
    opt.step()
    ref_opt.zero_grad()
    xs, ts = zip(*(batch(r, step) for r in range(size)))
    ((ref_gain * ref_model(torch.cat(xs)) - torch.cat(ts)) ** 2).mean().backward()
    ref_opt.step()
pairs = []  # (this rank's CUDA parameter on the host, the CPU reference's)
for (name, p), q in zip(named, list(ref_model.parameters()) + [ref_gain]):
    assert p.grad.device == dev, name
    pairs.append((p.detach().cpu(), q.detach()))
    np.testing.assert_allclose(pairs[-1][0].numpy(), pairs[-1][1].numpy(), rtol=1e-4,
                               atol=1e-5, err_msg=name)
if rank == 0:  # for the GPU check's log: how far CUDA on several ranks is from one CPU process
    print(f"optimizer on CUDA, {size} ranks, against one CPU process: max |difference| "
          f"{max(float((p - q).abs().max()) for p, q in pairs):.3g}, bit for bit: "
          f"{all(torch.equal(p, q) for p, q in pairs)}", flush=True)

# A sparse embedding on the GPU is reduced densely and its gradient handed back sparse, so
# SparseAdam steps, as one process on the global batch does on the CPU.
torch.manual_seed(0)
ref_emb = torch.nn.Embedding(10, 3, sparse=True)
emb = torch.nn.Embedding(10, 3, sparse=True).to(dev)
with torch.no_grad():
    emb.weight.copy_(ref_emb.weight)
opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                               emb.named_parameters())
ref_opt = torch.optim.SparseAdam(list(ref_emb.parameters()), lr=0.1)
ids = [torch.tensor([[r % 10, (3 * r + 1) % 10]]) for r in range(size)]
for step in range(2):
    opt.zero_grad()
    (emb(ids[rank].to(dev)) * (step + 1)).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse and emb.weight.grad.device == dev
    ref_opt.zero_grad()
    (sum(ref_emb(i).sum() for i in ids) * (step + 1) / size).backward()
    ref_opt.step()
np.testing.assert_allclose(emb.weight.detach().cpu().numpy(), ref_emb.weight.detach().numpy(),
                           rtol=1e-5, atol=1e-6)

print("torch CUDA collectives match NumPy", flush=True)
