"""Run examples/gluon_digits.py once per --compression value given, in one launch (MXNet
starts once); each run prints its epochs as the example does."""
import os
import runpy
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                       "examples", "gluon_digits.py")

for compression in sys.argv[1:]:
    sys.argv = [EXAMPLE, "--compression", compression]
    runpy.run_path(EXAMPLE, run_name="__main__")
