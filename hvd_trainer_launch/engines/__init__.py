"""Running a function on N ranks: through hvdrun (hvd_trainer.run), on Spark (hvd_trainer.spark)
and on Ray (hvd_trainer.ray). The drivers' halves, the agents that run the MPI launcher's proxies
in place of ssh, the ranks' side, and the outcome record each rank sends back."""
