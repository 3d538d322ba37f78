"""Misused collectives of hvd_trainer.mxnet raise what horovod.mxnet raises (MXNetError) and
still what the framework-free API raises (ValueError, TypeError, MismatchError)."""
import mxnet as mx
import numpy as np
import pytest
from mxnet.base import MXNetError

import hvd_trainer
import hvd_trainer.mxnet as hvd
from hvd_trainer.mxnet.errors import as_mxnet_error


@pytest.mark.parametrize("call,kind,words", [
    (lambda: hvd.alltoall(mx.nd.ones((3, 2)), splits=[2]), ValueError, "splits=[2]"),
    (lambda: hvd.allreduce(np.ones(3)), TypeError, "tensor must be an mxnet NDArray"),
    (lambda: hvd.broadcast_object(1, root_rank=5), ValueError, "root_rank=5"),
    (lambda: hvd.allreduce(mx.nd.ones(2), op="mean"), ValueError, "op="),
])
def test_misused_collective_is_an_mxnet_error_and_the_core_error(call, kind, words):
    hvd.init()
    with pytest.raises(MXNetError) as caught:
        call()
    assert isinstance(caught.value, kind)
    assert words in str(caught.value)


def test_translation_keeps_message_fields_and_mismatch_class():
    error = hvd_trainer.MismatchError("allreduce 'w': ranks disagree on shape")
    error.tensor = "w"
    translated = as_mxnet_error(error)
    assert isinstance(translated, MXNetError) and isinstance(translated, hvd.MismatchError)
    assert str(translated) == str(error) and translated.tensor == "w"
    assert as_mxnet_error(translated) is translated
