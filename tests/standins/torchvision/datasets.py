"""torchvision.datasets.MNIST over the idx files in ``root``/MNIST/raw (the four that
torchvision's MNIST downloads and reads); nothing is downloaded."""
import os
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

__all__ = ["MNIST"]


def _read_idx(path: str) -> np.ndarray:
    """An idx file's uint8 array: a big-endian magic (0x08 = uint8, then the number of
    dimensions), the sizes, the values."""
    with open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[:4], "big")
    if magic >> 8 != 0x08:
        raise ValueError(f"{path}: not an idx file of uint8 values (magic {magic:#x})")
    dims = magic & 0xFF
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


class MNIST(torch.utils.data.Dataset):
    """(image, label) pairs, the image an HxW uint8 array (torchvision gives a PIL image,
    which the stand-in's ToTensor does not need), the transform applied to it."""

    def __init__(self, root: str, train: bool = True, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None, download: bool = False):
        raw = os.path.join(root, "MNIST", "raw")
        prefix = "train" if train else "t10k"
        paths = [os.path.join(raw, f"{prefix}-{kind}") for kind in
                 ("images-idx3-ubyte", "labels-idx1-ubyte")]
        missing = [path for path in paths if not os.path.exists(path)]
        if missing:
            raise RuntimeError(f"MNIST stand-in: {', '.join(missing)} missing; the test writes "
                               "them (download=True downloads nothing here)")
        self.data, self.targets = (torch.from_numpy(_read_idx(path).copy()) for path in paths)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        image, target = self.data[index].numpy(), int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
