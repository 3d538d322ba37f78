"""horovod.keras's names: the same module as :mod:`hvd_trainer.tensorflow.keras` (Keras 3 on
TensorFlow), so ``import hvd_trainer.keras as hvd`` works for scripts written for
horovod.keras."""
from ..tensorflow.keras import *  # noqa: F401,F403  (the same names, by design)
from ..tensorflow.keras import __all__  # noqa: F401
