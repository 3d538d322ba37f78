"""tests/peer/run_peer_suites.py's elastic scenarios (test/integration): what it exports for
one, and the horovod.runner shim through which their horovodrun command lines run on hvdrun."""
import os
import subprocess
import sys

import pytest

from test_peer_harness import _git, harness, tagged_mirror


def test_export_of_an_elastic_scenario_takes_its_training_script_and_helpers(tmp_path):
    mirror, out = tmp_path / "mirror", tmp_path / "out"
    files = {"test/integration/test_elastic_torch.py": "from elastic_common import Base\n",
             "test/integration/elastic_common.py": "from common import temppath\n",
             "test/integration/data/elastic_torch_main.py": "import horovod.torch as hvd\n",
             "test/utils/common.py": "temppath = None\n",
             "test/conftest.py": "import sys\n"}
    tagged_mirror(mirror, files)
    exported = harness.export_suites(str(mirror), "v1", ["test_elastic_torch.py"], str(out))
    assert sorted(exported) == sorted(files)
    _git(mirror, "rm", "-q", "test/integration/data/elastic_torch_main.py")
    _git(mirror, "commit", "-q", "-m", "no script")
    _git(mirror, "tag", "v2")
    with pytest.raises(SystemExit, match="no test/integration/data/elastic_torch_main.py"):
        harness.export_suites(str(mirror), "v2", ["test_elastic_torch.py"], str(tmp_path / "o2"))


def test_elastic_shim_runs_the_horovodrun_line_with_hvdrun_and_raises_on_failure(tmp_path):
    """parse_args reads sys.argv as horovodrun does, set_env_from_args gives hvdrun's rank
    variables, and _run_elastic runs hvdrun: None when the job succeeds, RuntimeError with
    the message the suites match when it fails, and the mirror's reset-limit message when
    hvdrun says --reset-limit ended it."""
    mirror = tmp_path / "mirror"
    tagged_mirror(mirror, {"horovod/runner/elastic/constants.py":
                           "RESET_LIMIT_EXCEEDED_MESSAGE = 'over the limit of {} resets'\n"})
    shim = tmp_path / "shim"
    harness.write_shim(str(shim))
    harness.export_horovod_modules(str(mirror), "v1", str(shim))
    check = """
import sys
from horovod.runner.common.util import config_parser
from horovod.runner.launch import parse_args, _run_elastic

def run(*line):
    sys.argv[1:] = line
    args = parse_args()
    try:
        _run_elastic(args)
        return args, "ok"
    except RuntimeError as error:
        return args, str(error)

exits = "import os, sys; sys.exit(int(sys.argv[1].split(',')[int(os.environ['HOROVOD_RANK'])]))"
args, ended = run("-np", "2", "--min-num-proc", "1", "--log-level", "DEBUG", "-H",
                  "localhost:2", "--reset-limit", "0", sys.executable, "-c", exits, "0,3")
assert args.min_np == 1 and args.hosts == "localhost:2", vars(args)
assert config_parser.set_env_from_args({}, args)["HVD_LOG_LEVEL"] == "debug"
print(ended)
print(run("-np", "1", "--min-num-proc", "1", "-H", "localhost:1", sys.executable, "-c",
          exits, "4")[1].split(" (")[0])
print(run("-np", "2", "--min-num-proc", "2", "-H", "localhost:2", sys.executable, "-c",
          exits, "0,0")[1])
"""
    env = dict(os.environ, PYTHONPATH=str(shim))
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.splitlines() == [
        "over the limit of 0 resets",
        "Horovod detected that one or more processes exited with non-zero status", "ok"], \
        proc.stderr
