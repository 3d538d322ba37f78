"""The cache of GPU communicators (backends/companions.py, used by hvd_trainer.cuda.ops):
an entry goes, and its communicator is freed, when its host communicator goes. Fakes stand in
for both communicators, so this runs without CuPy or a GPU."""
import gc

from hvd_trainer.backends.companions import Companions


class FakeHost:
    """A host communicator: what a GPU communicator reads from it."""

    rank, size = 0, 2

    def allreduce(self, buf, op):
        return buf


class FakeGPU:
    """Keeps its host communicator, as HostStagedCommunicator and NCCLCommunicator do."""

    freed = []

    def __init__(self, host):
        self.host = host
        self.rank, self.size = host.rank, host.size

    def free(self):
        FakeGPU.freed.append(self)


def test_an_entry_goes_with_its_host_communicator_and_is_freed():
    FakeGPU.freed.clear()
    cache = Companions()
    host, other = FakeHost(), FakeHost()
    made = cache.add(host, FakeGPU)
    kept = cache.add(other, FakeGPU)
    assert cache.get(host) is made and cache.get(other) is kept and len(cache) == 2
    assert (made.rank, made.size) == (0, 2) and made.host.allreduce(5, "sum") == 5
    del host
    gc.collect()
    assert len(cache) == 1 and cache.get(other) is kept
    assert FakeGPU.freed == [made]

