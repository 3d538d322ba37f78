"""DistributedTrainer's 4th to 6th positional arguments, in either of two orders.

gluon.Trainer takes ``(params, optimizer, optimizer_params, kvstore, compression_params,
update_on_kvstore)``; horovod.mxnet's DistributedTrainer takes ``(params, optimizer,
optimizer_params, compression, gradient_predivide_factor, prefix)``. A 4th argument that is a
compression (``Compression.none``/``fp16``, a Compressor class of one's own, a
GatherCompressor or ``Compression.powersgd(...)``) selects horovod.mxnet's order; anything else is gluon's kvstore.
"""
from typing import Any, NamedTuple, Optional

import mxnet as mx

from ..collectives.powersgd import PowerSGD
from ..compression import Compression, Compressor, GatherCompressor
from ..compression import AnyCompressor


class TrainerArguments(NamedTuple):
    """The arguments by their meaning, whichever order they were given in."""

    kvstore: Any
    compression_params: Any
    update_on_kvstore: Any
    compression: AnyCompressor
    gradient_predivide_factor: float
    prefix: Optional[str]


def is_compression(value: Any) -> bool:
    """Whether ``value`` is a compression (``Compression.none``/``fp16``, a Compressor class
    of one's own, a ``GatherCompressor`` or ``Compression.powersgd(...)``) rather than a
    kvstore."""
    return isinstance(value, (GatherCompressor, PowerSGD)) or value is PowerSGD or (
        isinstance(value, type) and issubclass(value, Compressor))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_positional(fourth: Any, fifth: Any, sixth: Any, *, compression: AnyCompressor,
                    gradient_predivide_factor: float, prefix: Optional[str]
                    ) -> TrainerArguments:
    """The trainer's arguments from its 4th to 6th positions (gluon's names: ``kvstore``,
    ``compression_params``, ``update_on_kvstore``) and the keywords of horovod.mxnet's order.

    In horovod.mxnet's order (a compression 4th), a number 5th is the predivide factor and a
    string 6th the prefix; one given both by position and by keyword is a TypeError, as is a
    4th argument that is neither a compression nor a kvstore (a str, a KVStore or None).
    """
    if not is_compression(fourth):
        if not (fourth is None or isinstance(fourth, (str, mx.kvstore.KVStoreBase))):
            raise TypeError(f"DistributedTrainer's 4th argument is {fourth!r}: give gluon."
                            "Trainer's kvstore (a str or KVStore) or horovod.mxnet's compression "
                            "(Compression.none, Compression.fp16, Compression.powersgd(...) or a "
                            "GatherCompressor)")
        return TrainerArguments(fourth, fifth, sixth, compression, gradient_predivide_factor,
                                prefix)
    if compression is not Compression.none:
        raise TypeError("DistributedTrainer got compression twice: as its 4th argument "
                        "(horovod.mxnet's order) and as compression=")
    compression_params = fifth
    if _is_number(fifth):
        if gradient_predivide_factor != 1.0:
            raise TypeError("DistributedTrainer got gradient_predivide_factor twice: as "
                            "its 5th argument (horovod.mxnet's order) and as a keyword")
        gradient_predivide_factor, compression_params = float(fifth), None
    update_on_kvstore = sixth
    if isinstance(sixth, str):
        if prefix is not None:
            raise TypeError("DistributedTrainer got prefix twice: as its 6th argument "
                            "(horovod.mxnet's order) and as prefix=")
        prefix, update_on_kvstore = sixth, None
    return TrainerArguments("device", compression_params, update_on_kvstore, fourth,
                            gradient_predivide_factor, prefix)
