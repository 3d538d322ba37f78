"""Stands in for SciPy in the test jobs whose workers use neither it, scikit-learn nor
Lightning (runner.run_ranks puts this folder first on their PYTHONPATH). MXNet imports scipy.stats and
scipy.sparse at its own import when SciPy is installed (for quantization calibration, its test
utilities and CSR conversion, which no such worker uses): about 0.8 s of each MXNet rank's
2.9 s of CPU on 2 cores. On this ImportError it goes on without them, as where SciPy is not
installed."""
raise ImportError("SciPy is hidden from this test job by tests/parallel/runner.py; a worker "
                  "that uses it names scipy in its source")
