"""A test-only stand-in for the few names of torchvision that Horovod's
examples/ray/pytorch_ray_elastic.py uses (``datasets.MNIST``, ``transforms.Compose``,
``ToTensor``, ``Normalize``), for tests/engines/test_horovod_ray_elastic_example.py.

The torchvision that pip finds for torch 2.13.0 (0.28.0) is a CUDA 13 build: it installs
without another torch or CUDA package, but its operators do not load beside the CPU torch
(``import torchvision`` fails: ``operator torchvision::nms does not exist``), and the CPU
build is not on PyPI. So the test puts this folder on the driver's and the ranks'
PYTHONPATH. MNIST reads the idx files that torchvision's reads, from the same place, and
never downloads."""
from . import datasets, transforms

__all__ = ["datasets", "transforms"]
__version__ = "0.0+hvd_trainer.test"
