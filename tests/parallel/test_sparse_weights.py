"""row_sparse weights on 3 ranks against gluon.Trainer(kvstore='device') on the global
batch (with a dense gradient: against a dense twin, see the worker), and broadcast_parameters
of them (see workers/sparse_weights_equivalence.py, in the Gluon workers' shared job,
runner.MXNET_JOB); the
recommendation example on 2 ranks."""
import os
import re

import pytest

from runner import MXNET_JOB, MXNET_JOB_SECONDS, REPO, case_job, case_names, run_ranks


@pytest.mark.parametrize("case", case_names("sparse_weights_equivalence.py"))
@pytest.mark.parametrize("np_", [3])
def test_row_sparse_weights_match_gluon_trainer_on_the_global_batch(np_, case):
    case_job(MXNET_JOB, np_, timeout=MXNET_JOB_SECONDS).check(case)


def test_recommendation_example_learns_and_moves_less_than_its_tables():
    out = run_ranks(os.path.join(REPO, "examples", "sparse_weights.py"), 2,
                    ["--users", "2000", "--items", "1000", "--ratings", "30000", "--epochs", "3",
                     "--batch-size", "256"], timeout=180).stdout
    baseline = float(re.search(r"predicting the mean rating: held-out RMSE ([\d.]+)", out)[1])
    epochs = re.findall(r"held-out RMSE ([\d.]+), [\d.]+ ms/step, gradient rows moved ([\d.]+) "
                        r"MB per step \(the tables hold ([\d.]+) MB\)", out)
    assert len(epochs) == 3, out
    rmse, moved, tables = map(float, epochs[-1])
    assert rmse < 0.9 * baseline, out
    assert moved < tables, out
