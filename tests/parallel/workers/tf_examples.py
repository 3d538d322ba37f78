"""The TensorFlow examples one after the other in one job, so that each rank starts
TensorFlow once: examples/keras_digits.py, then examples/tf_digits_tape.py, each run as a
script with its default arguments. Rank 0 prints ``EXAMPLE <file>`` before each."""
import os
import runpy
import sys

import hvd_trainer

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples")

hvd_trainer.init()
for name in ("keras_digits.py", "tf_digits_tape.py"):
    if hvd_trainer.rank() == 0:
        print(f"EXAMPLE {name}", flush=True)
    sys.argv = [os.path.join(EXAMPLES, name)]
    runpy.run_path(sys.argv[0], run_name="__main__")
