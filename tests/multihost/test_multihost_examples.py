"""The bundled Gluon and torch examples on 2 ranks across two hosts train as on one host.

Both launches run on the test bed (-H h1:1,h2:1, then -H h1:2); the ranks hold the same
shards either way, so the last epoch's loss and accuracies must agree (to one test sample,
in case the MPI library sums in another order between hosts than within one).
"""
import importlib.util
import os
import re
import sys

import pytest

from multihost import REPO, hvdrun

EPOCHS = 5
TEST_SAMPLES = 450  # the digits' test split (a quarter of 1797)
LAST = re.compile(rf"\[0\]<stdout>:epoch +{EPOCHS} +loss ([\d.]+) +train acc ([\d.]+) +"
                  r"test acc ([\d.]+)")


@pytest.fixture(scope="module", params=[("gluon_digits.py", "mxnet"), ("torch_digits.py", "torch")],
                ids=["gluon", "torch"])
def runs(request, bed):
    """The example's last epoch on two hosts and on one: {layout: (loss, train acc, test acc)},
    and the bytes h2's links carried during the two-host run."""
    example, framework = request.param
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} not installed here; {example} runs in the [test] environment")
    results, moved = {}, None
    for layout in ("h1:1,h2:1", "h1:2"):
        before = bed.link_bytes("h2", "lan0") + bed.link_bytes("h2", "lan1")
        proc = hvdrun(bed, ["-np", 2, "-H", layout, sys.executable,
                            os.path.join(REPO, "examples", example), "--epochs", EPOCHS],
                      timeout=300)
        assert proc.returncode == 0, f"{layout}: {proc.stdout}\n{proc.stderr}"
        if layout == "h1:1,h2:1":
            moved = bed.link_bytes("h2", "lan0") + bed.link_bytes("h2", "lan1") - before
        last = LAST.search(proc.stdout)
        assert last, proc.stdout
        results[layout] = tuple(map(float, last.groups()))
    return results, moved


def test_the_example_trains_across_hosts_to_the_accuracy_of_one_host(runs):
    results, _ = runs
    (loss, train, test), (one_loss, one_train, one_test) = results["h1:1,h2:1"], results["h1:2"]
    assert abs(test - one_test) <= 1 / TEST_SAMPLES + 1e-4, results
    assert abs(train - one_train) <= 0.002 and abs(loss - one_loss) <= 0.01 * one_loss, results
    assert test >= 0.85, results  # it learns: 10 classes, 0.1 by chance


def test_the_gradients_cross_the_link(runs):
    # Over 10,000 float32 gradients summed at each of the 5 x 22 steps: over 4 MB each way,
    # where start-up, ssh and output take some 100 kB.
    _, moved = runs
    assert moved > 8e6, moved
