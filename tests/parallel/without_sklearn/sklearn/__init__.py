"""Stands in for scikit-learn in the test jobs whose workers do not use it (runner.run_ranks
puts this folder first on their PYTHONPATH). MXNet and Keras import sklearn at their own
import when it is installed (for estimator wrappers no test uses), which cost each rank about
a second of CPU on 2 cores; on this ImportError they go on without it, as where it is not
installed."""
raise ImportError("scikit-learn is hidden from this test job by tests/parallel/runner.py; "
                  "a worker that uses it names sklearn in its source")
