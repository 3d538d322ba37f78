"""``DistributedGradientTape`` and ``PartialDistributedGradientTape``: a ``tf.GradientTape``
whose ``gradient()`` reduces its results across ranks through the shared reduction
(gradients.py), as horovod.tensorflow's tapes do."""
from typing import Any, Dict, List

import tensorflow as tf

from ..collectives.arguments import Average
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .compression import Compression
from .gradients import Reduction
from .keras2 import is_keras2


class _DistributedTape:
    """The methods DistributedGradientTape adds to the wrapped tape's class."""

    _reduction: Reduction
    _local_sources: set  # ids of the sources kept local
    _scale_local_gradients: bool

    @bridge.plain_python
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The tape's gradients of ``target``, each reduced across the process set (except
        those of sources registered as local, which are divided by the set's size when
        ``scale_local_gradients``). A collective: every rank of the set calls it, with the
        same sources."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        result = self._reduction.reduce_shared(tf.nest.flatten(grads), tf.nest.flatten(sources),
                                               self._local_sources, self._scale_local_gradients)
        return tf.nest.pack_sequence_as(sources, result)

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None,
                                       use_generic_names: bool = False) -> Any:
        """:meth:`gradient`'s results as two lists of (source, gradient) pairs, in the
        sources' order: those of the sources registered as local, and the others (Horovod's;
        ``use_generic_names`` has no effect)."""
        local, shared = [], []
        for source, grad in zip(sources, self.gradient(target, sources, output_gradients)):
            (local if id(source) in self._local_sources else shared).append((source, grad))
        return local, shared

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local: it is not reduced (see :meth:`gradient`)."""
        self._local_sources.add(id(source))


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: Any = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients averaged (``op=Average``) or
    summed (``op=Sum``) over ``process_set``, as horovod.tensorflow's DistributedGradientTape.

    Returns a tape of a subclass of ``gradtape``'s class sharing what it recorded (wrap it
    before or after the ``with`` block). ``compression``: ``Compression.none``,
    ``Compression.fp16`` or a core packed compressor (``hvd_trainer.compression``).
    ``sparse_as_dense`` makes IndexedSlices dense before the reduction.
    ``gradient_predivide_factor`` f (Average only) scales by 1/f before the sum and f/size
    after. ``num_groups`` > 0 sets the number of buckets (``groups`` as an integer too).
    ``device_dense`` and ``device_sparse`` are accepted and have no effect; a list of
    variable groups in ``groups`` and ``op=Adasum`` are refused.
    """
    if groups is not None:
        if isinstance(groups, list):
            raise ValueError("groups= as lists of variables is not supported by "
                             "hvd_trainer.tensorflow: the reducer lays out its own buckets; "
                             "pass num_groups= (an integer) instead")
        num_groups = groups
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    reduction = Reduction("DistributedGradientTape.", compression, sparse_as_dense, op,
                          gradient_predivide_factor, num_groups, process_set)
    cls = _tape_class(type(gradtape))
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._reduction = reduction
    tape._local_sources = set()
    tape._scale_local_gradients = bool(scale_local_gradients)
    return tape


_tape_classes: Dict[type, type] = {}


def _tape_class(base: type) -> type:
    """``base`` with :class:`_DistributedTape`'s methods in front."""
    if issubclass(base, _DistributedTape):
        raise ValueError("gradtape is already a DistributedGradientTape; wrap it only once")
    if base not in _tape_classes:
        _tape_classes[base] = type(base.__name__, (_DistributedTape, base),
                                   {"__doc__": base.__doc__})
    return _tape_classes[base]


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "",
                                   compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: Any = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` whose gradients of ``local_layers``' trainable
    weights (a Keras layer or a list of them) stay local."""
    local_layers = local_layers_of(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape


def local_layers_of(local_layers: Any) -> List[Any]:
    """``local_layers`` (None, a Keras layer or a list of them; Keras 3's or Keras 2's) as a
    list of layers."""
    import keras

    def is_layer(layer: Any) -> bool:
        return isinstance(layer, keras.layers.Layer) or (
            is_keras2(layer) and hasattr(layer, "trainable_weights"))

    if local_layers is None:
        return []
    if is_layer(local_layers):
        return [local_layers]
    local_layers = list(local_layers)
    if not all(is_layer(layer) for layer in local_layers):
        raise ValueError("local_layers must be Keras layers (keras.layers.Layer, or "
                         "tf_keras.layers.Layer)")
    return local_layers
