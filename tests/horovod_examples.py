"""Horovod's Spark estimator examples for the tests that run them unmodified (tests/engines on
a local-cluster, the multi-host test bed's Spark driver): each script read from the local
Horovod mirror at run time (nothing of Horovod's lives in this repository), and the MNIST file
their download would fetch, written here instead (nothing is downloaded)."""
import bz2
import os
import subprocess
from typing import Optional

import numpy as np

MIRROR = os.environ.get("HVD_HOROVOD_MIRROR", "/work/.mirror/horovod+horovod/repo")
TAG = "v0.28.1"
PYTORCH_MNIST = "examples/spark/pytorch/pytorch_spark_mnist.py"
KERAS_MNIST = "examples/spark/keras/keras_spark_mnist.py"
PYTORCH_RAY_ELASTIC = "examples/ray/pytorch_ray_elastic.py"


def missing() -> Optional[str]:
    """Why the examples cannot be read (no mirror), or None."""
    shown = subprocess.run(["git", "-C", MIRROR, "rev-parse", "--verify", "-q", TAG],
                           capture_output=True)
    if shown.returncode != 0:
        return (f"Horovod's examples are read from a local Horovod mirror, and {MIRROR} has "
                f"no {TAG} (set HVD_HOROVOD_MIRROR)")
    return None


def write_example(path: str, folder: str) -> str:
    """Write the example at ``path`` in the mirror into ``folder``; its new path."""
    script = os.path.join(folder, os.path.basename(path))
    with open(script, "wb") as out:
        out.write(subprocess.run(["git", "-C", MIRROR, "show", f"{TAG}:{path}"],
                                 capture_output=True, check=True).stdout)
    return script


def write_mnist(folder: str, rows: int = 120) -> None:
    """What the examples' download fetches, as ``folder``/mnist.bz2: LIBSVM lines ``label
    index:value...`` of 784 random pixels, bz2-compressed; every digit appears."""
    rng = np.random.default_rng(0)
    lines = []
    for row in range(rows):
        pixels = rng.random(784)
        kept = np.flatnonzero(pixels > 0.7)
        values = " ".join(f"{i + 1}:{pixels[i]:.3f}" for i in kept)
        lines.append(f"{row % 10} {values}")
    with open(os.path.join(folder, "mnist.bz2"), "wb") as f:
        f.write(bz2.compress(("\n".join(lines) + "\n").encode()))


def write_mnist_idx(folder: str, train_rows: int = 256, test_rows: int = 64) -> None:
    """What torchvision's ``datasets.MNIST(folder, download=True)`` would fetch, as the four
    files it reads (``folder``/MNIST/raw/, the idx format: big-endian magic and sizes, then
    uint8 values), so that it downloads nothing. Each image is its digit's bright 7x7 block
    (digit d at row d // 4, column d % 4 of a 4x4 grid) over faint noise: a pattern a small
    net learns within an epoch."""
    raw = os.path.join(folder, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, rows in (("train", train_rows), ("t10k", test_rows)):
        labels = (np.arange(rows) % 10).astype(np.uint8)
        images = rng.integers(0, 40, (rows, 28, 28), dtype=np.uint8)
        for image, digit in zip(images, labels):
            image[7 * (digit // 4):7 * (digit // 4) + 7, 7 * (digit % 4):7 * (digit % 4) + 7] = 255
        for name, magic, array in (("images-idx3-ubyte", 2051, images),
                                   ("labels-idx1-ubyte", 2049, labels)):
            header = np.array([magic, *array.shape], dtype=">i4").tobytes()
            with open(os.path.join(raw, f"{prefix}-{name}"), "wb") as f:
                f.write(header + array.tobytes())


def arguments(folder: str, store: str) -> list:
    """The examples' arguments in the tests: 3 ranks, one epoch of batches of 8, the data in
    ``folder`` and the store at ``store``."""
    return ["--num-proc", "3", "--epochs", "1", "--batch-size", "8", "--work-dir", store,
            "--data-dir", folder]


def accuracy(out: str) -> Optional[float]:
    """The test accuracy an example printed (its one ``Test accuracy:`` line), or None."""
    found = [line for line in out.splitlines() if line.startswith("Test accuracy:")]
    return float(found[0].split()[-1]) if len(found) == 1 else None
