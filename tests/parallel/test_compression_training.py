"""Compressed DistributedTrainer on 3 ranks: MXNet's own 2-bit as reference, identical
weights on every rank, residuals (and PowerSGD's state) in save_checkpoint, byte counts;
digits convergence."""
import re

import pytest

from runner import case_job, case_names, run_ranks


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("compression")


@pytest.mark.parametrize("case", case_names("compression_cases.py"))
@pytest.mark.parametrize("np_", [3])
def test_compression_cases(np_, folder, case):
    where = folder / str(np_)
    where.mkdir(exist_ok=True)
    case_job("compression_cases.py", np_, [str(where)], timeout=120).check(case)


def test_digits_scaled_2bit_topk_and_powersgd_match_uncompressed():
    """The digits example on 2 ranks, its default 25 epochs: the scaled 2-bit variant and
    top-k 0.01 each end within 2 points of uncompressed test accuracy, PowerSGD at rank 4
    within 1 point."""
    settings = ["none", "scaled_2bit", "topk,ratio=0.01", "powersgd,rank=4,start_iter=100"]
    out = run_ranks("compression_digits.py", 2, settings, timeout=300).stdout
    final = [float(a) for a in re.findall(r"epoch 25 .* test acc ([0-9.]+)", out)]
    assert len(final) == len(settings), out
    dense, scaled, topk, low_rank = final
    assert scaled >= dense - 0.02 and topk >= dense - 0.02, dict(zip(settings, final))
    assert low_rank >= dense - 0.01, dict(zip(settings, final))
    assert "last step: sent" in out
