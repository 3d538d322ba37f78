"""torchvision.transforms' Compose, ToTensor (an HxW or HxWxC uint8 array to a CxHxW float
tensor in [0, 1]) and Normalize (per channel: (x - mean) / std)."""
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["Compose", "Normalize", "ToTensor"]


class Compose:
    def __init__(self, transforms: Sequence[Callable]):
        self.transforms = list(transforms)

    def __call__(self, value: Any) -> Any:
        for transform in self.transforms:
            value = transform(value)
        return value


class ToTensor:
    def __call__(self, image: np.ndarray) -> torch.Tensor:
        array = image[:, :, None] if image.ndim == 2 else image
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))).float() / 255


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std
