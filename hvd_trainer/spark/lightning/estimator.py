"""horovod.spark.lightning: ``TorchEstimator(model=LightningModule, ...)``, whose ``fit(df)``
trains the module with a Lightning 2 Trainer and :class:`hvd_trainer.torch.lightning.HorovodStrategy`
on every rank and returns a ``TorchModel`` (the module's predictions on the executors).

The module defines its optimizer (``configure_optimizers``), loss and logging, and receives
batches as dicts of column name to tensor (``batch['features']``), as in Horovod. Horovod's
parameters for its Petastorm loaders and Lightning 1 (``data_module``, ``loader_num_epochs``,
``terminate_on_nan``, ``num_gpus``...) are accepted; ``trainer_args`` go to the Trainer.
"""
import copy
import io
import time
from typing import Any, Dict, Optional

from pyspark import keyword_only
from pyspark.ml.param.shared import Param, Params

from hvd_trainer.spark.common import checks
from hvd_trainer.spark.common.estimator import HorovodEstimator
from hvd_trainer.spark.common.params import add_accessors
from hvd_trainer.spark.common.serialization import ParamsReadable, ParamsWritable
from hvd_trainer.spark.lightning import remote
from hvd_trainer.spark.torch.estimator import TorchModel as _TorchModel

__all__ = ["TorchEstimator", "TorchModel"]

# Horovod's Lightning-only parameters: name -> its CamelCase.
_LIGHTNING_PARAMS = {
    "input_shapes": "InputShapes", "loss_constructors": "LossConstructors",
    "train_minibatch_fn": "TrainMinibatchFn", "num_gpus": "NumGPUs", "logger": "Logger",
    "log_every_n_steps": "LogEveryNSteps", "data_module": "DataModule",
    "loader_num_epochs": "LoaderNumEpochs", "terminate_on_nan": "TerminateOnNan",
    "profiler": "Profiler", "trainer_args": "TrainerArgs", "debug_data_loader": "DebugDataLoader",
    "train_async_data_loader_queue_size": "TrainAsyncDataLoaderQueueSize",
    "val_async_data_loader_queue_size": "ValAsyncDataLoaderQueueSize"}


class TorchModel(_TorchModel):
    """A trained LightningModule (Horovod's Lightning TorchModel): ``getModel()``,
    ``getHistory()`` (each epoch's logged metrics), ``transform(df)``."""


class TorchEstimator(HorovodEstimator, ParamsWritable, ParamsReadable):
    """Horovod's Lightning TorchEstimator (see the module docstring)."""
    input_shapes = Param(Params._dummy(), "input_shapes", "input layer shapes")
    loss_constructors = Param(Params._dummy(), "loss_constructors", "accepted (the module's)")
    train_minibatch_fn = Param(Params._dummy(), "train_minibatch_fn", "accepted")
    num_gpus = Param(Params._dummy(), "num_gpus", "accepted: a rank uses its GPU if it has one")
    logger = Param(Params._dummy(), "logger", "a Lightning logger")
    log_every_n_steps = Param(Params._dummy(), "log_every_n_steps", "logging interval")
    data_module = Param(Params._dummy(), "data_module", "accepted (Petastorm's)")
    loader_num_epochs = Param(Params._dummy(), "loader_num_epochs", "accepted")
    terminate_on_nan = Param(Params._dummy(), "terminate_on_nan", "accepted")
    profiler = Param(Params._dummy(), "profiler", "a Lightning profiler")
    trainer_args = Param(Params._dummy(), "trainer_args", "more Trainer arguments")
    debug_data_loader = Param(Params._dummy(), "debug_data_loader", "accepted")
    train_async_data_loader_queue_size = Param(Params._dummy(),
                                               "train_async_data_loader_queue_size", "accepted")
    val_async_data_loader_queue_size = Param(Params._dummy(),
                                             "val_async_data_loader_queue_size", "accepted")

    @keyword_only
    def __init__(self, num_proc=None, model=None, backend=None, store=None, optimizer=None,
                 loss=None, loss_constructors=None, metrics=None, loss_weights=None,
                 sample_weight_col=None, gradient_compression=None, feature_cols=None,
                 input_shapes=None, validation=None, label_cols=None, callbacks=None,
                 batch_size=None, val_batch_size=None, epochs=None, verbose=1,
                 random_seed=None, shuffle_buffer_size=None, shuffle=True,
                 partitions_per_process=None, run_id=None, train_minibatch_fn=None,
                 train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, transformation_edit_fields=None,
                 transformation_removed_fields=None, train_reader_num_workers=None,
                 trainer_args=None, val_reader_num_workers=None, reader_pool_type=None,
                 label_shapes=None, inmemory_cache_all=False, num_gpus=None, logger=None,
                 log_every_n_steps=50, data_module=None, loader_num_epochs=None,
                 terminate_on_nan=False, profiler=None, debug_data_loader=False,
                 train_async_data_loader_queue_size=None,
                 val_async_data_loader_queue_size=None, use_gpu=True,
                 mp_start_method=None) -> None:
        super().__init__()
        self._setDefault(**{**{name: None for name in _LIGHTNING_PARAMS},
                            "log_every_n_steps": 50, "terminate_on_nan": False,
                            "debug_data_loader": False})
        kwargs = self._input_kwargs
        if kwargs.get("transformation_fn") is not None:
            raise ValueError("transformation_fn is not supported by hvd_trainer's Lightning "
                             "estimator (docs/limitations.md): transform the DataFrame first")
        self.setParams(**kwargs)

    def _check_model(self) -> None:
        import pytorch_lightning as pl
        super()._check_model()
        if not isinstance(self.getModel(), pl.LightningModule):
            raise ValueError(f"model is a {type(self.getModel()).__name__}, not a "
                             "LightningModule: use hvd_trainer.spark.torch.TorchEstimator for "
                             "a torch.nn.Module")

    def _spec(self, train_rows: int, val_rows: int, run_id: str,
              dataset_idx: Optional[int]) -> remote.LightningSpec:
        trainer_args = dict(self.getTrainerArgs() or {})
        trainer_args.setdefault("log_every_n_steps", self.getLogEveryNSteps())
        if self.getProfiler() is not None:
            trainer_args.setdefault("profiler", self.getProfiler())
        return remote.LightningSpec(
            **self._data_fields(train_rows, val_rows, run_id, dataset_idx),
            callbacks=list(self.getCallbacks() or []), logger=self.getLogger(),
            trainer_args=trainer_args)

    def _fit_on_prepared_data(self, backend: Any, train_rows: int, val_rows: int,
                              metadata: Dict[str, Any], avg_row_size: float,
                              dataset_idx: Optional[int] = None) -> TorchModel:
        import torch
        run_id = self.getRunId() or f"pytorch_lightning_{int(time.time())}"
        spec = self._spec(train_rows, val_rows, run_id, dataset_idx)
        # The module travels pickled: a backend in this process trains a copy, as the ranks do.
        result = backend.run(remote.train, args=(
            spec, checks.check_picklable("model", self.getModel())))[0]
        model = copy.deepcopy(self.getModel())
        model.load_state_dict(torch.load(io.BytesIO(result.state), map_location="cpu",
                                         weights_only=True))
        model.eval()
        return TorchModel(history=result.history, model=model,
                          feature_columns=self.getFeatureCols(),
                          input_shapes=self.getInputShapes(), label_columns=self.getLabelCols(),
                          run_id=run_id, _metadata=metadata)


add_accessors(TorchEstimator, _LIGHTNING_PARAMS)
