"""horovod.spark.common.estimator: what the Keras, torch and Lightning estimators share.

``fit(df)`` checks its input on the driver (columns, types, shapes, store, num_proc, that the
model pickles), writes the DataFrame to Parquet in the store once (prepare), and hands the
framework's half (``_fit_on_prepared_data``) a backend to train on; the framework's half
returns its Spark ML ``Model``.
"""
import abc
from typing import Any, Dict, Optional

from pyspark.ml import Estimator, Model

from hvd_trainer.spark.common import checks, payload, prepare
from hvd_trainer.spark.common.backend import Backend, SparkBackend
from hvd_trainer.spark.common.params import EstimatorParams, ModelParams

__all__ = ["HorovodEstimator", "HorovodModel"]


class HorovodEstimator(Estimator, EstimatorParams):
    """An estimator that trains on every rank of a backend; subclasses give the framework."""

    def fit(self, df: Any, params: Optional[Dict] = None) -> Model:
        """Train on DataFrame ``df`` (``params``: a param map overriding these); the trained
        model, as a Spark ML Model."""
        return super().fit(df, params)

    def fit_on_parquet(self, params: Optional[Dict] = None,
                       dataset_idx: Optional[int] = None) -> Model:
        """Train on a Parquet dataset already in the store: one prepare_data wrote
        (``dataset_idx``), or the files at the store's training (and validation) paths."""
        estimator = self.copy(params) if params else self
        backend = estimator._get_or_create_backend()
        if dataset_idx is not None and prepare.is_prepared(dataset_idx):
            properties = prepare.get_dataset_properties(dataset_idx)
        else:
            weight = [self.getSampleWeightCol()] if self.getSampleWeightCol() else []
            properties = prepare.properties_from_parquet(
                self.getStore(), list(dict.fromkeys(
                    self.getFeatureCols() + self.getLabelCols() + weight)), dataset_idx)
        estimator._check_metadata_compatibility(properties.metadata)
        return estimator._fit_on_prepared_data(backend, properties.train_rows,
                                               properties.val_rows, properties.metadata,
                                               properties.avg_row_size, dataset_idx)

    def _fit(self, df: Any) -> Model:
        checks.check_store(self.getStore())
        if self.getModel() is None:
            raise ValueError("model is required: pass the model to train (model=...)")
        self._check_model()
        backend = self._get_or_create_backend()
        if isinstance(backend, SparkBackend):
            checks.check_num_proc(backend.num_processes())
            checks.check_store_shared(self.getStore(), backend.num_processes())
        with prepare.prepare_data(backend.num_processes(), self.getStore(), df,
                                  label_columns=self.getLabelCols(),
                                  feature_columns=self.getFeatureCols(),
                                  validation=self.getValidation(),
                                  sample_weight_col=self.getSampleWeightCol(),
                                  compress_sparse=self.getCompressSparseCols(),
                                  partitions_per_process=self.getPartitionsPerProcess(),
                                  verbose=self.getVerbose(),
                                  check_metadata=self._check_metadata_compatibility) as idx:
            properties = prepare.get_dataset_properties(idx)
            return self._fit_on_prepared_data(backend, properties.train_rows,
                                              properties.val_rows, properties.metadata,
                                              properties.avg_row_size, idx)

    def _check_model(self) -> None:
        """Framework checks of the model on the driver (pickling, input shapes)."""
        checks.check_picklable("model", self.getModel())

    def _check_metadata_compatibility(self, metadata: Dict[str, Any]) -> None:
        prepare.check_shape_compatibility(metadata, self.getFeatureCols(), self.getLabelCols(),
                                          label_shapes=self.getLabelShapes())

    @abc.abstractmethod
    def _fit_on_prepared_data(self, backend: Backend, train_rows: int, val_rows: int,
                              metadata: Dict[str, Any], avg_row_size: float,
                              dataset_idx: Optional[int] = None) -> Model:
        """Train on the prepared dataset ``dataset_idx``; the trained Spark ML Model."""

    def _data_fields(self, train_rows: int, val_rows: int, run_id: str,
                     dataset_idx: Optional[int]) -> Dict[str, Any]:
        """The fields of a :class:`~hvd_trainer.spark.common.feed.DataSpec` for this fit."""
        store = self.getStore()
        checkpoint = store.get_checkpoint_path(run_id)
        weight = [self.getSampleWeightCol()] if self.getSampleWeightCol() else []
        return dict(
            store=store, train_path=store.get_train_data_path(dataset_idx),
            val_path=store.get_val_data_path(dataset_idx) if val_rows else None,
            checkpoint_path=store.join_path(checkpoint, store.get_checkpoint_filename())
            if checkpoint else None,
            columns=list(dict.fromkeys(self.getFeatureCols() + self.getLabelCols() + weight)),
            train_rows=train_rows, val_rows=val_rows, batch_size=self.getBatchSize(),
            val_batch_size=self.getValBatchSize() or self.getBatchSize(),
            epochs=self.getEpochs(), train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(),
            shuffle=self.getShuffle() and self.getShufflingBufferSize() != 0,
            shuffle_buffer_size=self.getShufflingBufferSize(), random_seed=self.getRandomSeed(),
            inmemory_cache_all=self.getInMemoryCacheAll(), use_gpu=self.getUseGpu(),
            verbose=self.getVerbose())

    def _get_or_create_backend(self) -> Backend:
        backend = self.getBackend()
        if backend is None:
            return SparkBackend(self.getNumProc(), verbose=self.getVerbose())
        if self.getNumProc() is not None:
            raise ValueError("give at most one of backend= and num_proc= (the backend sets "
                             "the number of processes)")
        return backend

    def _read_checkpoint(self, run_id: str) -> Optional[bytes]:
        """The run's checkpoint in the store, its digest verified (before anything unpickles
        it), or None when the run has none."""
        store = self.getStore()
        folder = store.get_checkpoint_path(run_id)
        path = store.join_path(folder, store.get_checkpoint_filename()) if folder else None
        if path is None or not store.exists(path):
            return None
        if self.getVerbose():
            print(f"hvd_trainer.spark: resuming from the checkpoint {path}", flush=True)
        return payload.unpack(store.read(path), f"the checkpoint {path}")


class HorovodModel(Model, ModelParams):
    """A trained model: ``transform(df)`` adds its predictions (``<label>__output`` unless
    setOutputCols names them), computed on the executors."""

    def transform(self, df: Any, params: Optional[Dict] = None) -> Any:
        """``df`` with the prediction columns added."""
        return super().transform(df, params)
