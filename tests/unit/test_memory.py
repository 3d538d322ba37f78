"""One implementation of each collective serves host and GPU memory: run them on a stand-in
Memory whose hooks record what the collectives ask of them, in a size-1 world."""
import numpy as np

import hvd_trainer as hvd
from hvd_trainer.collectives import fusion, memory, ops
from hvd_trainer.runtime import runtime


class Recording(memory.Memory):
    """Host arrays, but every hook that a GPU memory overrides is counted."""

    def __init__(self):
        self.calls = []

    def check(self, tensor, arg, inplace=False):
        self.calls.append(("check", arg, inplace))
        return super().check(tensor, arg, inplace)

    def mover(self, process_set):
        self.calls.append(("mover",))
        return super().mover(process_set)

    def pool(self, comm):
        self.calls.append(("pool",))
        return fusion.BufferPool()

    def pack(self, tensors, out, scale=1.0):
        self.calls.append(("pack", len(tensors)))
        fusion.pack(tensors, out, scale)

    def unpack(self, flat, outputs, scale=1.0):
        self.calls.append(("unpack", len(outputs)))
        fusion.unpack(flat, outputs, scale)


def kinds(memory):
    return [c[0] for c in memory.calls]


def test_allreduce_family_uses_the_memory_hooks():
    m = Recording()
    xs = [np.arange(3.0), np.ones((2, 2))]
    out = ops.reduce_group(m, xs, hvd.Sum, "g", 2.0, 1.0, hvd.global_process_set,
                           kind="grouped_allreduce", inplace=False)
    for x, o in zip(xs, out):
        np.testing.assert_array_equal(o, x * 2)
        assert not np.shares_memory(o, x)
    assert kinds(m) == ["check", "check", "mover", "pool", "pack", "unpack"]


def test_gather_broadcast_and_reducescatter_use_the_memory_hooks():
    m = Recording()
    x = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(ops.allgather_rows(m, x, "a", hvd.global_process_set), x)
    y = x.copy()
    assert ops.broadcast_in(m, y, 0, "b", hvd.global_process_set, True) is y
    (share,) = ops.scatter_reduce(m, [x], hvd.Average, "r", hvd.global_process_set, 1.0, 3.0,
                                  "reducescatter")
    np.testing.assert_array_equal(share, x * 3)
    assert kinds(m) == ["check", "mover", "check", "mover", "check", "mover", "pack", "unpack"]
    assert runtime.size() == 1
