"""horovod.spark.keras: ``KerasEstimator(model=, optimizer=, loss=, metrics=, ...)``, whose
``fit(df)`` trains a Keras 3 model on every rank (hvd_trainer.tensorflow.keras) and returns a
``KerasModel`` (a Spark ML Model whose ``transform`` runs the trained model on the executors).

Horovod's semantics: the optimizer's learning rate is multiplied by the number of ranks while
training; a ``run_id`` whose checkpoint is in the store resumes from it (its weights, the
optimizer's state and the unscaled rate) and trains ``epochs`` more; feature columns are
reshaped to the model's inputs and labels to its outputs (or ``label_shapes``).
"""
import time
from typing import Any, Dict, Optional

import cloudpickle
from pyspark import keyword_only
from pyspark.ml.param.shared import Param, Params

from hvd_trainer.spark.common import checks, transform
from hvd_trainer.spark.common.estimator import HorovodEstimator, HorovodModel
from hvd_trainer.spark.common.params import add_accessors
from hvd_trainer.spark.common.serialization import ParamsReadable, ParamsWritable
from hvd_trainer.spark.keras import remote

__all__ = ["KerasEstimator", "KerasModel"]

_OPTIMIZER = "hvd_trainer keras optimizer config"  # how a saved optimizer parameter is marked


def _model_parts(model: Any) -> tuple:
    """(JSON, weights): what travels and is saved instead of the Keras model object."""
    return model.to_json(), model.get_weights()


def _rebuild(parts: tuple, custom_objects: Optional[Dict[str, Any]]) -> Any:
    import keras
    model_json, weights = parts
    model = keras.models.model_from_json(model_json, custom_objects=custom_objects or {})
    model.set_weights(weights)
    return model


class _KerasParams:
    """Saving a Keras model parameter as its JSON and weights (ParamsWritable's hooks)."""

    def _serialize_param(self, name: str, value: Any) -> bytes:
        if name == "model":
            return cloudpickle.dumps(_model_parts(value))
        if name == "optimizer" and hasattr(value, "get_config"):
            import keras
            return cloudpickle.dumps({_OPTIMIZER: keras.optimizers.serialize(value)})
        return cloudpickle.dumps(value)

    @classmethod
    def _deserialize_param(cls, name: str, data: bytes) -> Any:
        value = cloudpickle.loads(data)
        if name == "model":
            return _rebuild(value, None)
        if name == "optimizer" and isinstance(value, dict) and _OPTIMIZER in value:
            import keras
            return keras.optimizers.deserialize(value[_OPTIMIZER])
        return value


class KerasEstimator(_KerasParams, HorovodEstimator, ParamsWritable, ParamsReadable):
    """Horovod's KerasEstimator: the parameters of
    :class:`~hvd_trainer.spark.common.params.EstimatorParams` plus ``custom_objects`` and
    ``checkpoint_callback`` (accepted; the estimator writes its own checkpoint). Keras's
    ``gradient_accumulation_steps`` on the optimizer stands for ``backward_passes_per_step``."""
    custom_objects = Param(Params._dummy(), "custom_objects", "custom Keras objects")
    checkpoint_callback = Param(Params._dummy(), "checkpoint_callback", "accepted")
    data_module = Param(Params._dummy(), "data_module", "accepted (Petastorm's)")
    backend_env = Param(Params._dummy(), "backend_env", "environment for the default backend")

    @keyword_only
    def __init__(self, num_proc=None, data_module=None, model=None, backend=None, store=None,
                 custom_objects=None, optimizer=None, loss=None, loss_weights=None,
                 sample_weight_col=None, gradient_compression=None, metrics=None,
                 feature_cols=None, label_cols=None, continuous_cols=None,
                 categorical_cols=None, validation=None, callbacks=None, batch_size=None,
                 val_batch_size=None, epochs=None, verbose=None, random_seed=None,
                 shuffle_buffer_size=None, shuffle=True, partitions_per_process=None,
                 run_id=None, train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, train_reader_num_workers=None,
                 val_reader_num_workers=None, reader_pool_type="thread", label_shapes=None,
                 checkpoint_callback=None, inmemory_cache_all=False, backend_env=None,
                 use_gpu=True, mp_start_method=None) -> None:
        super().__init__()
        self._setDefault(custom_objects={}, checkpoint_callback=None, data_module=None,
                         backend_env=None)
        kwargs = self._input_kwargs
        if kwargs.get("transformation_fn") is not None:
            raise ValueError("transformation_fn is not supported by hvd_trainer's Keras "
                             "estimator (docs/limitations.md): transform the DataFrame first")
        self.setParams(**kwargs)

    def _check_model(self) -> None:
        import keras
        model = self.getModel()
        if not isinstance(model, keras.Model):
            raise ValueError(f"model is a {type(model).__name__}, not a Keras model")
        if self.getOptimizer() is None:
            raise ValueError("optimizer is required: a Keras optimizer "
                             "(optimizer=keras.optimizers.SGD(0.01))")
        if self.getLoss() is None:
            raise ValueError("loss is required: a Keras loss, or one per output")
        checks.check_picklable("loss", self.getLoss())
        checks.check_picklable("metrics", self.getMetrics())

    def _check_metadata_compatibility(self, metadata: Dict[str, Any]) -> None:
        from hvd_trainer.spark.common import prepare
        model = self.getModel()
        shapes = [[-1, *[d for d in t.shape[1:]]] for t in model.inputs]
        if any(d is None for shape in shapes for d in shape):
            shapes = None
        prepare.check_shape_compatibility(metadata, self.getFeatureCols(), self.getLabelCols(),
                                          input_shapes=shapes,
                                          label_shapes=self.getLabelShapes())

    def _load_checkpoint(self, run_id: str) -> Optional[Dict[str, Any]]:
        """The run's checkpoint in the store (verified before it is unpickled), or None."""
        data = self._read_checkpoint(run_id)
        return None if data is None else cloudpickle.loads(data)

    def _fit_on_prepared_data(self, backend: Any, train_rows: int, val_rows: int,
                              metadata: Dict[str, Any], avg_row_size: float,
                              dataset_idx: Optional[int] = None) -> "KerasModel":
        import keras
        run_id = self.getRunId() or f"keras_{int(time.time())}"
        model_json, weights = _model_parts(self.getModel())
        optimizer = self.getOptimizer()
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        spec = remote.KerasSpec(
            **self._data_fields(train_rows, val_rows, run_id, dataset_idx),
            feature_columns=self.getFeatureCols(), label_columns=self.getLabelCols(),
            sample_weight_col=self.getSampleWeightCol(), label_shapes=self.getLabelShapes(),
            custom_objects=self.getCustomObjects() or {}, model_json=model_json,
            weights=weights, optimizer_config=keras.optimizers.serialize(optimizer),
            loss=self.getLoss(), loss_weights=self.getLossWeights(),
            metrics=list(self.getMetrics() or []), callbacks=list(self.getCallbacks() or []),
            gradient_compression=self.getGradientCompression(),
            checkpoint=self._load_checkpoint(run_id))
        result = backend.run(remote.train, args=(spec,), env=self.getBackendEnv())[0]
        model = _rebuild((model_json, result.weights), self.getCustomObjects())
        return KerasModel(history=result.history, model=model,
                          feature_columns=self.getFeatureCols(),
                          label_columns=self.getLabelCols(),
                          custom_objects=self.getCustomObjects(), run_id=run_id,
                          _metadata=metadata)


add_accessors(KerasEstimator, {"custom_objects": "CustomObjects",
                               "checkpoint_callback": "CheckpointCallback",
                               "data_module": "DataModule", "backend_env": "BackendEnv"})


class KerasModel(_KerasParams, HorovodModel, ParamsWritable, ParamsReadable):
    """A trained Keras model (Horovod's KerasModel): ``getModel()``, ``getHistory()`` (Keras's
    history, the same on every rank), ``transform(df)``."""
    custom_objects = Param(Params._dummy(), "custom_objects", "custom Keras objects")
    _floatx = Param(Params._dummy(), "_floatx", "Keras's float type (accepted)")

    @keyword_only
    def __init__(self, history=None, model=None, feature_columns=None, label_columns=None,
                 custom_objects=None, run_id=None, _metadata=None, _floatx=None) -> None:
        super().__init__()
        if label_columns:
            self.setOutputCols([f"{column}__output" for column in label_columns])
        self._setDefault(custom_objects={}, _floatx=None)
        self.setParams(**self._input_kwargs)

    def _transform(self, df: Any) -> Any:
        parts = _model_parts(self.getModel())
        custom_objects = self.getCustomObjects()

        def make_predict():
            model = _rebuild(parts, custom_objects)

            def predict(inputs):
                import numpy as np
                shaped = [remote.shaped(x, t.shape) for x, t in zip(inputs, model.inputs)]
                outputs = model(shaped[0] if len(shaped) == 1 else shaped, training=False)
                if not isinstance(outputs, (list, tuple)):
                    outputs = [outputs]
                return [np.asarray(o) for o in outputs]
            return predict

        return transform.model_transform(df, self._get_metadata(), self.getFeatureColumns(),
                                         self.getLabelColumns(), self.getOutputCols(),
                                         make_predict)


add_accessors(KerasModel, {"custom_objects": "CustomObjects"})
