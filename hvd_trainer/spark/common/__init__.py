"""horovod.spark.common: what the Spark estimators share (stores, backends, parameters, the
Parquet data path, checks on the driver)."""
__all__ = []
