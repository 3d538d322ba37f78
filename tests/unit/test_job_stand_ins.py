"""The test jobs' stand-ins (tests/parallel/runner.py's STAND_INS): which jobs get them, and
that eager torch trains the same under the torch._dynamo one while a name it lacks fails
loudly."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "parallel"))

import runner  # noqa: E402  (after its folder is on the path)
from runner import WITHOUT_DYNAMO, WITHOUT_SCIPY, WITHOUT_SKLEARN  # noqa: E402


def _script(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_job_gets_each_stand_in_whose_words_none_of_its_scripts_names(tmp_path):
    plain = _script(tmp_path, "plain.py", "import torch\n")
    compiles = _script(tmp_path, "compiles.py", "model = torch.compile(model)\n")
    learns = _script(tmp_path, "learns.py", "from sklearn.datasets import load_digits\n")
    example = _script(tmp_path, "example.py", "runpy.run_path('examples/x.py')\n")
    sparse = _script(tmp_path, "sparse.py", "import scipy.sparse\n")
    assert runner._stand_ins([plain]) == [WITHOUT_SKLEARN, WITHOUT_SCIPY, WITHOUT_DYNAMO]
    assert runner._stand_ins([plain, compiles]) == [WITHOUT_SKLEARN, WITHOUT_SCIPY]  # any script
    assert runner._stand_ins([learns, "--flag"]) == [WITHOUT_DYNAMO]  # not a file: no words
    assert runner._stand_ins([sparse]) == [WITHOUT_SKLEARN, WITHOUT_DYNAMO]
    fits = _script(tmp_path, "fits.py", "import pytorch_lightning as pl\n")
    assert runner._stand_ins([fits]) == [WITHOUT_SKLEARN]  # torchmetrics imports scipy
    assert runner._stand_ins([example]) == []


_TRAIN = """
import json
import sys
import torch
model = torch.nn.Linear(2, 1, bias=False)
with torch.no_grad():
    model.weight.copy_(torch.tensor([[1.0, -2.0]]))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
for _ in range(2):
    optimizer.zero_grad()
    model(torch.tensor([[1.0, 3.0]])).sum().backward()
    optimizer.step()
try:
    torch._dynamo.config
    missing = None
except AttributeError as error:
    missing = str(error)
print(json.dumps({"weights": model.weight.detach().tolist()[0], "sympy": "sympy" in sys.modules,
                  "loader": type(sys.modules["torch._dynamo"].__spec__.loader).__name__,
                  "missing": missing}))
"""


def test_eager_torch_trains_the_same_under_the_dynamo_stand_in():
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=WITHOUT_DYNAMO)
    done = subprocess.run([sys.executable, "-c", _TRAIN], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    # By hand: the gradient is x = (1, 3) at both steps; momentum 0.9 makes the second step
    # 1.9 times the first: w - 0.5 * x * (1 + 1.9).
    assert said["weights"] == pytest.approx([1.0 - 1.45, -2.0 - 4.35])
    assert said["loader"] == "_StandIn" and not said["sympy"]  # the real import was skipped
    assert "tests/parallel/without_dynamo/sitecustomize.py" in said["missing"]
