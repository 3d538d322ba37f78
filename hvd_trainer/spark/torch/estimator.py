"""horovod.spark.torch: ``TorchEstimator(model=, optimizer=, loss=, input_shapes=, ...)``,
whose ``fit(df)`` trains a torch model on every rank and returns a ``TorchModel`` (a Spark ML
Model whose ``transform`` runs the trained model on the executors).

Horovod's semantics: the optimizer's learning rate is multiplied by the number of ranks while
training (the checkpoint and the returned optimizer keep the one given); a ``run_id`` whose
checkpoint is in the store resumes from it; the returned model is in eval mode.
"""
import copy
import io
import time
from typing import Any, Dict, List, Optional

from pyspark import keyword_only
from pyspark.ml.param.shared import Param, Params

from hvd_trainer.spark.common import checks, transform
from hvd_trainer.spark.common.estimator import HorovodEstimator, HorovodModel
from hvd_trainer.spark.common.params import EstimatorParams, add_accessors  # noqa: F401
# (EstimatorParams: horovod.spark.torch.estimator exports it, and Horovod's tests import it.)
from hvd_trainer.spark.common.serialization import ParamsReadable, ParamsWritable
from hvd_trainer.spark.torch import remote

__all__ = ["TorchEstimator", "TorchModel"]


def _as_list(value: Any, count: int) -> List[Any]:
    """A loss (or list of losses) as one per label column."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value] * count


def _batch_shape(shape: List[int], rows: int) -> List[int]:
    """An input shape for ``rows`` rows: its -1 is the row count, else rows come first."""
    return [rows if d == -1 else d for d in shape] if -1 in shape else [rows, *shape]


def _fresh_optimizer(model: Any, optimizer: Any) -> Any:
    """``optimizer``'s class and state on ``model``'s parameters (Horovod's getOptimizer)."""
    fresh = type(optimizer)(model.parameters(), lr=1)
    fresh.load_state_dict(optimizer.state_dict())
    return fresh


class TorchEstimator(HorovodEstimator, ParamsWritable, ParamsReadable):
    """Horovod's TorchEstimator: the parameters of
    :class:`~hvd_trainer.spark.common.params.EstimatorParams` plus ``input_shapes`` (one shape
    per feature column, -1 for the batch), ``loss_constructors`` and ``train_minibatch_fn``.
    ``data_module`` is accepted for Horovod's signature; the rows are read by hvd_trainer's
    Parquet reader."""
    data_module = Param(Params._dummy(), "data_module", "data module class (accepted)")
    input_shapes = Param(Params._dummy(), "input_shapes", "input layer shapes")
    loss_constructors = Param(Params._dummy(), "loss_constructors",
                              "functions that construct the loss")
    train_minibatch_fn = Param(Params._dummy(), "train_minibatch_fn",
                               "a function that builds the function of one training step")

    @keyword_only
    def __init__(self, num_proc=None, data_module=None, model=None, backend=None, store=None,
                 optimizer=None, loss=None, loss_constructors=None, metrics=None,
                 loss_weights=None, sample_weight_col=None, gradient_compression=None,
                 feature_cols=None, continuous_cols=None, categorical_cols=None,
                 input_shapes=None, validation=None, label_cols=None, callbacks=None,
                 batch_size=None, val_batch_size=None, epochs=None, verbose=1,
                 random_seed=None, shuffle_buffer_size=None, shuffle=True,
                 partitions_per_process=None, run_id=None, train_minibatch_fn=None,
                 train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, train_reader_num_workers=None,
                 val_reader_num_workers=None, reader_pool_type="thread", label_shapes=None,
                 inmemory_cache_all=False, use_gpu=True, mp_start_method=None,
                 backward_passes_per_step=1) -> None:
        super().__init__()
        self._setDefault(data_module=None, loss_constructors=None, input_shapes=None,
                         train_minibatch_fn=None, transformation_fn=None)
        kwargs = self._input_kwargs
        if "loss" in kwargs and "loss_constructors" in kwargs:
            raise ValueError("give loss= or loss_constructors=, not both")
        if backward_passes_per_step <= 0:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: give 1 "
                             "or more")
        if kwargs.get("transformation_fn") is not None:
            raise ValueError("transformation_fn is not supported by hvd_trainer's torch "
                             "estimator (docs/limitations.md): transform the DataFrame first")
        self.setParams(**kwargs)

    def _get_optimizer(self) -> Any:
        return self.getOrDefault(self.optimizer)

    def getOptimizer(self) -> Any:
        """The optimizer, rebuilt on the model's parameters (Horovod's)."""
        model, optimizer = self.getModel(), self._get_optimizer()
        return _fresh_optimizer(model, optimizer) if model and optimizer else optimizer

    def _check_model(self) -> None:
        super()._check_model()
        if self._get_optimizer() is None:
            raise ValueError("optimizer is required: a torch.optim optimizer over the model's "
                             "parameters (optimizer=torch.optim.SGD(model.parameters(), ...))")
        if self.getLoss() is None and self.getLossConstructors() is None:
            raise ValueError("loss is required: a loss function, or one per label column")
        self._check_forward()

    def _check_forward(self) -> None:
        """The model takes a batch of ``input_shapes`` (-1: two rows) of float32 zeros."""
        import torch
        shapes = self.getInputShapes()
        if not shapes:
            return
        model = self.getModel()
        inputs = [torch.zeros([2 if d == -1 else d for d in shape]) for shape in shapes]
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                model(*inputs)
        except Exception as error:
            raise ValueError(f"the model does not take inputs of input_shapes={shapes}: "
                             f"{type(error).__name__}: {error}; make input_shapes match "
                             "the model's forward()") from error
        finally:
            model.train(training)

    def _check_metadata_compatibility(self, metadata: Dict[str, Any]) -> None:
        from hvd_trainer.spark.common import prepare
        prepare.check_shape_compatibility(metadata, self.getFeatureCols(), self.getLabelCols(),
                                          input_shapes=self.getInputShapes(),
                                          label_shapes=self.getLabelShapes())

    def _load_checkpoint(self, run_id: str) -> Optional[Dict[str, Any]]:
        """The checkpoint of ``run_id`` in the store (verified before it is loaded), or None."""
        import torch
        data = self._read_checkpoint(run_id)
        return None if data is None else torch.load(io.BytesIO(data), weights_only=True)

    def _spec(self, train_rows: int, val_rows: int, run_id: str,
              dataset_idx: Optional[int]) -> remote.TrainSpec:
        labels = self.getLabelCols()
        metrics = self.getMetrics() or []
        groups = [list(g) for g in metrics] if metrics and isinstance(metrics[0], (list, tuple)) \
            else ([list(metrics)] if metrics else [])
        return remote.TrainSpec(
            **self._data_fields(train_rows, val_rows, run_id, dataset_idx),
            feature_columns=self.getFeatureCols(), label_columns=labels,
            sample_weight_col=self.getSampleWeightCol(), input_shapes=self.getInputShapes(),
            label_shapes=self.getLabelShapes(),
            loss_fns=_as_list(self.getLoss(), len(labels)),
            loss_constructors=_as_list(self.getLossConstructors(), len(labels)),
            loss_weights=self.getLossWeights() or [1.0 / len(labels)] * len(labels),
            metric_fn_groups=groups, backward_passes_per_step=self.getBackwardPassesPerStep(),
            gradient_compression=self.getGradientCompression(),
            train_minibatch_fn=self.getTrainMinibatchFn())

    def _fit_on_prepared_data(self, backend: Any, train_rows: int, val_rows: int,
                              metadata: Dict[str, Any], avg_row_size: float,
                              dataset_idx: Optional[int] = None) -> "TorchModel":
        import torch
        run_id = self.getRunId() or f"pytorch_{int(time.time())}"
        checkpoint = self._load_checkpoint(run_id)
        model, optimizer = self.getModel(), self._get_optimizer()
        state = checkpoint or {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        out = io.BytesIO()
        torch.save(state, out)
        spec = self._spec(train_rows, val_rows, run_id, dataset_idx)
        # The model travels pickled, so that a backend running in this process (a test's)
        # trains a copy, as the ranks do, never the estimator's own model.
        results = backend.run(remote.train, args=(spec, checks.check_picklable("model", model),
                                                  type(optimizer), out.getvalue()))
        return self._create_model(results[0], run_id, metadata)

    def _create_model(self, result: remote.RankResult, run_id: str,
                      metadata: Dict[str, Any]) -> "TorchModel":
        import torch
        state = torch.load(io.BytesIO(result.checkpoint), map_location="cpu", weights_only=True)
        model = copy.deepcopy(self.getModel())
        model.load_state_dict(state["model"])
        model.eval()
        optimizer = _fresh_optimizer(model, self._get_optimizer())
        optimizer.load_state_dict(state["optimizer"])
        return TorchModel(history=result.history, model=model, optimizer=optimizer,
                          feature_columns=self.getFeatureCols(),
                          input_shapes=self.getInputShapes(), label_columns=self.getLabelCols(),
                          run_id=run_id, _metadata=metadata, loss=self.getLoss(),
                          loss_constructors=self.getLossConstructors())


add_accessors(TorchEstimator, {"data_module": "DataModule", "input_shapes": "InputShapes",
                               "loss_constructors": "LossConstructors",
                               "train_minibatch_fn": "TrainMinibatchFn"})


class TorchModel(HorovodModel, ParamsWritable, ParamsReadable):
    """A trained torch model (Horovod's TorchModel): ``getModel()`` the module,
    ``getHistory()`` the per-epoch metrics, ``transform(df)`` its predictions."""
    optimizer = Param(Params._dummy(), "optimizer", "optimizer")
    input_shapes = Param(Params._dummy(), "input_shapes", "input layer shapes")
    loss = Param(Params._dummy(), "loss", "loss")
    loss_constructors = Param(Params._dummy(), "loss_constructors",
                              "functions that construct the loss")

    @keyword_only
    def __init__(self, history=None, model=None, feature_columns=None, input_shapes=None,
                 label_columns=None, optimizer=None, run_id=None, _metadata=None, loss=None,
                 loss_constructors=None) -> None:
        super().__init__()
        if label_columns:
            self.setOutputCols([f"{column}__output" for column in label_columns])
        self._setDefault(optimizer=None, loss=None, loss_constructors=None, input_shapes=None)
        self.setParams(**self._input_kwargs)

    def setOptimizer(self, value: Any) -> "TorchModel":
        return self._set(optimizer=value)

    def getOptimizer(self) -> Any:
        """The optimizer, rebuilt on the model's parameters (Horovod's)."""
        model, optimizer = self.getModel(), self.getOrDefault(self.optimizer)
        return _fresh_optimizer(model, optimizer) if model and optimizer else optimizer

    def _predictor(self) -> Any:
        """A function that builds, on an executor, the batch predictor of the model."""
        model_bytes = checks.check_picklable("model", self.getModel())
        shapes = self.getInputShapes()

        def make_predict():
            import cloudpickle
            import numpy as np
            import torch
            model = cloudpickle.loads(model_bytes)
            model.eval()

            def predict(inputs):
                tensors = [torch.from_numpy(np.ascontiguousarray(x)).float() for x in inputs]
                if shapes:
                    tensors = [t.reshape(_batch_shape(s, len(x)))
                               for t, x, s in zip(tensors, inputs, shapes)]
                with torch.no_grad():
                    outputs = model(*tensors)
                if not isinstance(outputs, (list, tuple)):
                    outputs = [outputs]
                return [o.detach().cpu().numpy() for o in outputs]
            return predict
        return make_predict

    def _transform(self, df: Any) -> Any:
        return transform.model_transform(df, self._get_metadata(), self.getFeatureColumns(),
                                         self.getLabelColumns(), self.getOutputCols(),
                                         self._predictor())


add_accessors(TorchModel, {"loss": "Loss", "loss_constructors": "LossConstructors",
                           "input_shapes": "InputShapes"})
