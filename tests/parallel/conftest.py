"""Settings shared by every multi-rank test job.

Rank counts: a case runs on 3 ranks, an odd size, so that ring chunks are uneven and a rank
has different neighbours on each side. It runs on 2 ranks as well only where the path under
test depends on the count: the collectives and the agreement (on 2 ranks a rank's left and
right neighbour are one rank), process sets, power-of-two Adasum, elastic growth and
shrinking. Training built on those paths (optimizers, trainers, join, elastic commits) runs
on 3 alone, its variants that change no rank-count path (the overlap, the buckets) on 2.
"""
import os

# Open MPI probes the libfabric and UCX transports at every start, about 1 s per job on a
# machine without such a fabric (the tests' one machine uses shared memory anyway). MPICH
# ignores the variable.
os.environ.setdefault("OMPI_MCA_btl", "^ofi,uct")


def pytest_collection_modifyitems(config, items):
    """With HVD_TEST_RANKS=n, only the cases run on n ranks (``np_``) and those that do not
    vary the rank count: CI's second pass, under Open MPI, runs the 3-rank cases (odd sizes
    catch the most) after the first has run every case under MPICH."""
    wanted = os.environ.get("HVD_TEST_RANKS")
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        ranks = getattr(item, "callspec", None) and item.callspec.params.get("np_")
        (drop if ranks is not None and ranks != int(wanted) else keep).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
