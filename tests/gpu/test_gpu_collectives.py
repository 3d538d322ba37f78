"""The GPU collectives where every rank has a GPU of its own, against NumPy: at world size 1
(NCCL's one-rank path), and on 3 ranks with NCCL between them, which needs 3 GPUs on a device
(the stand-in's machine has them). workers/collectives_worker.py holds the cases."""
import pytest

from gpu import KINDS, SMALL_BUCKETS, job, names, one_rank_job

CASES = [(np_, case) for np_ in (1, 3) for case in names("collectives_worker.py")]


@pytest.mark.parametrize("np_,case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_collectives_match_numpy(kind, np_, case):
    cases = one_rank_job(kind) if np_ == 1 else \
        job(kind, ("collectives_worker.py",), np_, layout="own", gpus=np_, env=SMALL_BUCKETS)
    cases.check(case)
