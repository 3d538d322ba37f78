"""row_sparse weights on 2 and 3 ranks against gluon.Trainer(kvstore='device') on the global
batch (see workers/sparse_weights_equivalence.py), and the recommendation example on 2 ranks."""
import os
import re

import pytest

from runner import REPO, run_ranks

SPARSE_WEIGHT_CASES = 9


@pytest.mark.parametrize("np_", [2, 3])
def test_row_sparse_weights_match_gluon_trainer_on_the_global_batch(np_):
    out = run_ranks("sparse_weights_equivalence.py", np_, timeout=180).stdout
    assert out.count("all sparse weight cases passed") == np_
    assert out.count("OK ") == SPARSE_WEIGHT_CASES
