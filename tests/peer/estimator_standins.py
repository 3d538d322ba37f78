"""What run_peer_suites.py needs for Horovod's Spark estimator suites (test/integration's
test_spark_torch.py, test_spark_keras.py, test_spark_lightning.py): single-process pytest files
whose tests start their own Spark sessions and fit estimators.

They import Horovod's internals beside the public estimators (helper factories, parameter
serializers, the Spark driver and task services of Horovod's own launcher, Petastorm-era
utilities); the shim's modules below stand in for them: each raises NotImplementedError
naming what it stands for, so the tests that use them fail as they should, and the rest of the
file runs. Public modules come from the shim (launch/horovod_shim.py), these are test-only.
The driver and task service stand-ins and the secret serve Horovod's test_spark.py too; the
harness's own stand-ins (run_peer_suites.SPARK_STAND_INS) add the rest of what it imports, and
its horovod.runner.mpi_run, the gate of that suite's MPI tests.
"""
from typing import Dict, Tuple

ESTIMATOR_SUITES: Tuple[str, ...] = ("test_spark_torch.py", "test_spark_keras.py",
                                     "test_spark_lightning.py")
# What each suite imports beyond pytest and the default helpers.
SUITE_MODULES: Dict[str, Tuple[str, ...]] = {
    "test_spark_torch.py": ("pyspark", "pyarrow", "torch", "psutil"),
    "test_spark_keras.py": ("pyspark", "pyarrow", "tensorflow", "psutil"),
    "test_spark_lightning.py": ("pyspark", "pyarrow", "torch", "pytorch_lightning", "psutil"),
}

_INTERNAL = '''

class _Internal:
    """A stand-in for one of Horovod's internal classes."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is Horovod's internal class; "
                                  "hvd_trainer has none")


def _internal(name):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"{name} is Horovod's internal helper; hvd_trainer has none")
    stand_in.__name__ = name
    return stand_in
'''


def _reexport(target: str, extra: str) -> str:
    """A shim module that carries ``target``'s names and the stand-ins ``extra`` defines."""
    return (f'"""Generated for the peer suites: {target}\'s names and stand-ins for Horovod\'s '
            f'internals."""\nimport {target} as _target\n\n'
            "globals().update({name: getattr(_target, name) for name in dir(_target)\n"
            '                  if not name.startswith("__")})\n' + _INTERNAL + extra)


STANDIN_MODULES: Dict[str, str] = {
    "horovod/runner/common/util/secret.py": '''"""Generated for the peer suites: a job secret."""
import os


def make_secret_key():
    return os.urandom(32)
''',
    "horovod/spark/driver/__init__.py": "",
    "horovod/spark/driver/driver_service.py": _INTERNAL.lstrip() + '''

class SparkDriverService(_Internal):
    pass


class SparkDriverClient(_Internal):
    pass
''',
    "horovod/spark/task/task_service.py": _INTERNAL.lstrip() + '''

class SparkTaskService(_Internal):
    pass


class SparkTaskClient(_Internal):
    pass
''',
    "horovod/spark/common/constants.py": '''"""Generated for the peer suites: Horovod's names of
the intermediate formats (hvd_trainer writes arrays and unchanged scalars)."""
from hvd_trainer.spark.common.prepare import ARRAY, NOCHANGE  # noqa: F401

CUSTOM_SPARSE = "custom_sparse_format"
# Horovod's sizing of Petastorm's shuffle buffers (test_spark_keras.py sizes a cluster by it).
TOTAL_BUFFER_MEMORY_CAP_GIB = 4
BYTES_PER_GIB = 1073741824
''',
    "horovod/spark/common/util/__init__.py": _reexport(
        "hvd_trainer.spark.common.prepare",
        '\n_wait_file_available_on_dbfs = _internal("_wait_file_available_on_dbfs")\n'
        '_get_spark_df_saved_file_list = _internal("_get_spark_df_saved_file_list")\n'
        'to_petastorm_fn = _internal("to_petastorm_fn")\n'
        '_get_metadata = get_metadata\n'),
    "horovod/spark/torch/estimator/__init__.py": _reexport(
        "hvd_trainer.spark.torch.estimator",
        '\n_torch_param_serialize = _internal("_torch_param_serialize")\n'),
    "horovod/spark/keras/util.py": _INTERNAL.lstrip() + '''

_custom_sparse_to_dense_fn = _internal("_custom_sparse_to_dense_fn")
_serialize_param_value = _internal("_serialize_param_value")


class TFKerasUtil(_Internal):
    pass
''',
    "horovod/spark/keras/estimator/__init__.py": _reexport(
        "hvd_trainer.spark.keras.estimator",
        "\nfrom hvd_trainer.spark.common.params import EstimatorParams  # noqa: E402,F401\n"),
    "horovod/spark/lightning/estimator/__init__.py": _reexport(
        "hvd_trainer.spark.lightning.estimator",
        '\nfrom hvd_trainer.spark.common.params import EstimatorParams  # noqa: E402,F401\n'
        '_torch_param_serialize = _internal("_torch_param_serialize")\n'
        'MIN_PL_VERSION = "2.1.0"\n'),
    "horovod/spark/lightning/legacy.py": _INTERNAL.lstrip() + '''

to_lightning_module = _internal("to_lightning_module")
''',
}
