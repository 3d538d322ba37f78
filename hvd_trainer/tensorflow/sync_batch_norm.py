"""``SyncBatchNormalization``: Keras batch normalization over every rank's batch, as Horovod's.

In training, the mean and variance are those of all ranks' batches together, so each rank
normalizes its rows and updates the moving statistics as one process would on the
concatenated batch. Ranks may hold different numbers of rows: each rank's statistics count
with its number of values (its mask's weight, if the layer is given a mask). The input
gradient is that of the global batch, since the allreduce's gradient is an allreduce; the
gamma and beta gradients stay local, for the optimizer's allreduce to sum. In inference it
is an ordinary BatchNormalization.

The class derives from ``tf.keras.layers.BatchNormalization`` as this module finds it when
first imported: Keras 2's (tf_keras) under ``TF_USE_LEGACY_KERAS=1``, else Keras 3's. It
reduces over the global process set.
"""
from typing import Any, Optional, Tuple

import tensorflow as tf

from ..collectives.arguments import Sum
from . import keras2
from .ops import allreduce

__all__ = ["SyncBatchNormalization"]

_BatchNormalization = tf.keras.layers.BatchNormalization
# Keras 2's BatchNormalization takes fused= and has another _moments signature than Keras 3's.
_KERAS2 = keras2.is_keras2_class(_BatchNormalization)


def _global_moments(mean: tf.Tensor, variance: tf.Tensor, count: tf.Tensor
                    ) -> Tuple[tf.Tensor, tf.Tensor]:
    """The mean and variance over every rank, from each rank's ``mean`` and ``variance`` of
    ``count`` values per channel (float64): sums of values and of squares add up across ranks, in
    float64 so that E[x²] - E[x]² keeps its digits."""
    mean64 = tf.cast(mean, tf.float64)
    # multiply_no_nan: a rank with no rows has a NaN mean and adds nothing.
    total = tf.math.multiply_no_nan(mean64, count)
    squares = tf.math.multiply_no_nan(tf.cast(variance, tf.float64) + mean64 ** 2, count)
    summed = allreduce(tf.stack([count, total, squares]), op=Sum)
    global_mean = summed[1] / summed[0]
    global_variance = tf.maximum(summed[2] / summed[0] - global_mean ** 2, 0.0)
    return tf.cast(global_mean, mean.dtype), tf.cast(global_variance, variance.dtype)


def _count(inputs: tf.Tensor, mean: tf.Tensor, mask: Optional[tf.Tensor],
           axes: Any) -> tf.Tensor:
    """How many values of ``inputs`` went into each channel of ``mean``: all of them, or the
    sum of ``mask`` over the reduced ``axes`` (Keras 2 and 3 both weigh a masked row by its
    mask, broadcast along the last axis)."""
    if mask is None:
        per_channel = tf.size(inputs, tf.int64) // tf.maximum(tf.size(mean, tf.int64), 1)
        return tf.fill(tf.shape(mean), tf.cast(per_channel, tf.float64))
    weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.float64), tf.shape(inputs))
    return tf.reshape(tf.reduce_sum(weights, axis=axes), tf.shape(mean))


class SyncBatchNormalization(_BatchNormalization):
    """``tf.keras.layers.BatchNormalization`` with its training statistics taken over every
    rank's batch (see the module docstring). A collective in training: every rank calls it
    at the same step. ``fused=True`` is refused: the fused kernel computes its own moments."""

    def __init__(self, fused: Optional[bool] = False, **kwargs: Any) -> None:
        if fused is not False:
            raise ValueError(f"SyncBatchNormalization(fused={fused!r}): the fused kernel "
                             "computes its statistics on one rank; pass fused=False or leave "
                             "it out")
        if _KERAS2:
            kwargs["fused"] = False
        super().__init__(**kwargs)

    if _KERAS2:
        def _moments(self, inputs: tf.Tensor, reduction_axes: Any, keep_dims: bool,
                     mask: Optional[tf.Tensor] = None) -> Tuple[tf.Tensor, tf.Tensor]:
            mean, variance = super()._moments(inputs, reduction_axes, keep_dims, mask=mask)
            return _global_moments(mean, variance, _count(inputs, mean, mask, reduction_axes))
    else:
        def _moments(self, inputs: tf.Tensor, mask: Optional[tf.Tensor]
                     ) -> Tuple[tf.Tensor, tf.Tensor]:
            mean, variance = super()._moments(inputs, mask)
            return _global_moments(mean, variance,
                                   _count(inputs, mean, mask, self._reduction_axes))
