"""Row-sparse gradients on 3 ranks against a single-process gluon.Trainer reference.

One launch, shared with the other Gluon workers (runner.MXNET_JOB), runs every case of
workers/sparse_equivalence.py (see its docstring);
one more runs the example on a small vocabulary.
"""
import os
import re

import pytest

from runner import MXNET_JOB, MXNET_JOB_SECONDS, REPO, case_job, case_names, run_ranks


@pytest.mark.parametrize("case", case_names("sparse_equivalence.py"))
@pytest.mark.parametrize("np_", [3])
def test_sparse_gradients_match_one_process_on_the_global_batch(np_, case):
    case_job(MXNET_JOB, np_, timeout=MXNET_JOB_SECONDS).check(case)


def test_example_reports_both_paths_and_the_sparse_one_moves_fewer_bytes():
    out = run_ranks(os.path.join(REPO, "examples", "sparse_embedding.py"), 2,
                    ["--vocab", "20000", "--dim", "16", "--docs", "512", "--epochs", "1"]).stdout
    moved = {path: float(mb) for path, mb in
             re.findall(r"(sparse|dense) +path: \d+ rows sent, ([\d.]+) MB per step", out)}
    assert set(moved) == {"sparse", "dense"}, out
    assert moved["sparse"] < moved["dense"] / 5, out
