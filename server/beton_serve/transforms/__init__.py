"""Augmentation and conversion ops (mirrors ``ffcv.transforms``; same names).

Every op draws its randomness from :mod:`beton_serve.pipeline.rng` as a pure function of
(seed, epoch, op position, sample id), so batches are bit-identical for any number of workers.
Importing this package imports neither Numba, OpenCV nor torch: they are imported when an op
generates or runs its code.
"""

from __future__ import annotations

from beton_serve.transforms.colorjitter import RandomBrightness, RandomContrast, RandomSaturation
from beton_serve.transforms.common import Squeeze
from beton_serve.transforms.cutout import Cutout
from beton_serve.transforms.flip import RandomHorizontalFlip
from beton_serve.transforms.mixup import ImageMixup, LabelMixup, MixupToOneHot
from beton_serve.transforms.module import ModuleWrapper
from beton_serve.transforms.normalize import NormalizeImage
from beton_serve.transforms.ops import Convert, ToDevice, ToTensor, ToTorchImage, View
from beton_serve.transforms.poisoning import Poison
from beton_serve.transforms.random_resized_crop import RandomResizedCrop
from beton_serve.transforms.replace_label import ReplaceLabel
from beton_serve.transforms.translate import RandomTranslate

__all__ = [
    "Convert",
    "Cutout",
    "ImageMixup",
    "LabelMixup",
    "MixupToOneHot",
    "ModuleWrapper",
    "NormalizeImage",
    "Poison",
    "RandomBrightness",
    "RandomContrast",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RandomSaturation",
    "RandomTranslate",
    "ReplaceLabel",
    "Squeeze",
    "ToDevice",
    "ToTensor",
    "ToTorchImage",
    "View",
]
