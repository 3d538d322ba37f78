"""horovod.spark.common.params: the estimators' and models' Spark ML ``Params``, with Horovod's
names, defaults, getters and setters (``setBatchSize``/``getBatchSize`` for ``batch_size``...).

The accessors are generated from one table (name -> the CamelCase Horovod uses), so that each
parameter is written once; Horovod's irregular names (``setShufflingBufferSize``,
``setTrainReaderNumWorker``, ``setLabelColoumns``) are kept as Horovod spells them.
"""
from typing import Any, Dict, Optional, Type

from pyspark import keyword_only
from pyspark.ml.param.shared import HasOutputCols, Param, Params, TypeConverters

__all__ = ["EstimatorParams", "ModelParams", "add_accessors"]

_T = TypeConverters


def add_accessors(cls: Type, names: Dict[str, str]) -> Type:
    """Give ``cls`` ``setX(value)`` and ``getX()`` for each parameter name -> X."""
    def accessors(param: str):
        def setter(self, value):
            return self._set(**{param: value})

        def getter(self):
            return self.getOrDefault(getattr(self, param))
        return setter, getter

    for param, camel in names.items():
        setter, getter = accessors(param)
        setter.__doc__ = f"Set ``{param}``; returns the object (Horovod's set{camel})."
        getter.__doc__ = f"The value of ``{param}`` (Horovod's get{camel})."
        for prefix, function in (("set", setter), ("get", getter)):
            if prefix + camel not in vars(cls):
                function.__name__ = prefix + camel
                setattr(cls, prefix + camel, function)
    return cls


def _param(name: str, doc: str, converter: Optional[Any] = None) -> Param:
    return Param(Params._dummy(), name, doc, **({"typeConverter": converter} if converter else {}))


class EstimatorParams(Params):
    """The parameters that every Horovod estimator takes."""
    num_proc = _param("num_proc", "number of processes")
    train_reader_num_workers = _param("train_reader_num_workers",
                                      "parallel readers of the training data (Petastorm's; "
                                      "accepted, one reading thread per rank is used)")
    val_reader_num_workers = _param("val_reader_num_workers",
                                    "parallel readers of the validation data (as above)")
    reader_pool_type = _param("reader_pool_type", "Petastorm's pool type (accepted)")
    optimizer = _param("optimizer", "optimizer")
    model = _param("model", "model")
    backend = _param("backend", "backend")
    store = _param("store", "store")
    metrics = _param("metrics", "metrics")
    loss = _param("loss", "loss")
    gradient_compression = _param("gradient_compression", "gradient compression")
    compress_sparse_cols = _param("compress_sparse_cols", "compress sparse vectors (accepted; "
                                  "they are written dense)", _T.toBoolean)
    loss_weights = _param("loss_weights", "loss weights", _T.toListFloat)
    sample_weight_col = _param("sample_weight_col", "name of the sample weight column",
                               _T.toString)
    feature_cols = _param("feature_cols", "feature column names", _T.toListString)
    label_cols = _param("label_cols", "label column names", _T.toListString)
    continuous_cols = _param("continuous_cols", "continuous column names", _T.toListString)
    categorical_cols = _param("categorical_cols", "categorical column names", _T.toListString)
    validation = _param("validation", "a validation fraction in [0, 1), or a column name")
    callbacks = _param("callbacks", "callbacks")
    batch_size = _param("batch_size", "batch size per rank", _T.toInt)
    val_batch_size = _param("val_batch_size", "validation batch size per rank", _T.toInt)
    epochs = _param("epochs", "epochs", _T.toInt)
    train_steps_per_epoch = _param("train_steps_per_epoch", "training steps per epoch",
                                   _T.toInt)
    validation_steps_per_epoch = _param("validation_steps_per_epoch",
                                        "validation steps per epoch", _T.toInt)
    random_seed = _param("random_seed", "random seed", _T.toInt)
    shuffle_buffer_size = _param("shuffle_buffer_size", "rows in the shuffle buffer", _T.toInt)
    shuffle = _param("shuffle", "whether to shuffle the training rows", _T.toBoolean)
    verbose = _param("verbose", "verbosity (0 silent, 1 an epoch line, 2 more)", _T.toInt)
    partitions_per_process = _param("partitions_per_process",
                                    "Parquet files per process", _T.toInt)
    run_id = _param("run_id", "the run's name in the store; an existing run resumes from its "
                    "checkpoint", _T.toString)
    transformation_fn = _param("transformation_fn", "a function applied to every batch")
    transformation_edit_fields = _param("transformation_edit_fields", "Petastorm's (accepted)")
    transformation_removed_fields = _param("transformation_removed_fields",
                                           "Petastorm's (accepted)")
    label_shapes = _param("label_shapes", "the shape of each label column")
    inmemory_cache_all = _param("inmemory_cache_all", "keep the decoded rows in memory",
                                _T.toBoolean)
    use_gpu = _param("use_gpu", "train on the rank's GPU when there is one", _T.toBoolean)
    mp_start_method = _param("mp_start_method", "multiprocessing start method (accepted)",
                             _T.toString)
    backward_passes_per_step = _param("backward_passes_per_step",
                                      "backward passes per allreduce", _T.toInt)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            num_proc=None, store=None, backend=None, model=None, optimizer=None, loss=None,
            loss_weights=None, sample_weight_col=None, metrics=[], feature_cols=None,
            label_cols=None, continuous_cols=None, categorical_cols=None, validation=None,
            gradient_compression=None, compress_sparse_cols=False, batch_size=32,
            val_batch_size=None, epochs=1, verbose=1, callbacks=[], random_seed=None,
            shuffle_buffer_size=None, shuffle=True, partitions_per_process=10, run_id=None,
            train_steps_per_epoch=None, validation_steps_per_epoch=None, transformation_fn=None,
            transformation_edit_fields=None, transformation_removed_fields=None,
            train_reader_num_workers=2, val_reader_num_workers=2, reader_pool_type="thread",
            label_shapes=None, inmemory_cache_all=False, use_gpu=True, mp_start_method=None,
            backward_passes_per_step=1)

    @keyword_only
    def setParams(self, **kwargs: Any) -> "EstimatorParams":
        return self._set(**kwargs)


add_accessors(EstimatorParams, {
    "num_proc": "NumProc", "model": "Model", "backend": "Backend", "store": "Store",
    "loss": "Loss", "loss_weights": "LossWeights", "sample_weight_col": "SampleWeightCol",
    "metrics": "Metrics", "feature_cols": "FeatureCols", "label_cols": "LabelCols",
    "continuous_cols": "ContinuousCols", "categorical_cols": "CategoricalCols",
    "validation": "Validation", "callbacks": "Callbacks", "batch_size": "BatchSize",
    "val_batch_size": "ValBatchSize", "epochs": "Epochs",
    "train_steps_per_epoch": "TrainStepsPerEpoch",
    "validation_steps_per_epoch": "ValidationStepsPerEpoch", "verbose": "Verbose",
    "gradient_compression": "GradientCompression", "compress_sparse_cols": "CompressSparseCols",
    "random_seed": "RandomSeed", "shuffle_buffer_size": "ShufflingBufferSize",
    "shuffle": "Shuffle", "optimizer": "Optimizer",
    "partitions_per_process": "PartitionsPerProcess", "run_id": "RunId",
    "transformation_fn": "TransformationFn",
    "transformation_edit_fields": "TransformationEditFields",
    "transformation_removed_fields": "TransformationRemovedFields",
    "train_reader_num_workers": "TrainReaderNumWorker",
    "val_reader_num_workers": "ValReaderNumWorker", "reader_pool_type": "ReaderPoolType",
    "label_shapes": "LabelShapes", "inmemory_cache_all": "InMemoryCacheAll",
    "use_gpu": "UseGpu", "mp_start_method": "MpStartMethod",
    "backward_passes_per_step": "BackwardPassesPerStep"})


class ModelParams(HasOutputCols):
    """The parameters of a trained model (Horovod's ModelParams)."""
    history = _param("history", "history")
    model = _param("model", "model")
    feature_columns = _param("feature_columns", "feature columns")
    label_columns = _param("label_columns", "label columns")
    run_id = _param("run_id", "the run that trained the model", _T.toString)
    _metadata = _param("_metadata", "the type and shape of each column")

    def __init__(self) -> None:
        super().__init__()

    def _get_metadata(self) -> Dict[str, Any]:
        return self.getOrDefault(self._metadata)

    @keyword_only
    def setParams(self, **kwargs: Any) -> "ModelParams":
        return self._set(**kwargs)

    def setOutputCols(self, value: Any) -> "ModelParams":
        """Set the output column names (one per label column)."""
        return self._set(outputCols=value)


add_accessors(ModelParams, {
    "history": "History", "model": "Model", "feature_columns": "FeatureColumns",
    "label_columns": "LabelColumns", "run_id": "RunId"})
ModelParams.setLabelColoumns = ModelParams.setLabelColumns  # Horovod's spelling
