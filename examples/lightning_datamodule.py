"""A PyTorch Lightning ``LightningDataModule`` whose loaders are served by beton-serve.

Lightning is not a dependency of beton-serve: this module imports without it (the class then
derives from ``object`` and shows the structure), and becomes a real ``LightningDataModule``
when ``lightning`` (or the older ``pytorch_lightning``) is installed::

    import lightning.pytorch as pl
    from lightning_datamodule import BetonDataModule

    dm = BetonDataModule("train.beton", "val.beton", batch_size=256)
    trainer = pl.Trainer(accelerator="gpu", devices=8, strategy="ddp",
                         use_distributed_sampler=False)   # the Loader splits the data itself
    trainer.fit(model, datamodule=dm)

Three things matter with Lightning (they are the FFCV + Lightning pitfalls too, see
Lightning-AI/pytorch-lightning#19409):

1. ``use_distributed_sampler=False``: Lightning must not wrap the loader in a
   ``DistributedSampler``. ``beton_client.Loader(distributed=True)`` already gives each rank its
   share, following FFCV's (torch's ``DistributedSampler``) rules.
2. Create the loaders in ``train_dataloader()`` / ``val_dataloader()``, not in ``__init__``: by
   then Lightning has initialised ``torch.distributed``, and the Loader takes rank and world size
   from it.
3. A batch is valid until the next one is requested. Lightning consumes a batch before asking
   for the next, so this is safe; pass ``copy=True`` if a callback keeps batches around.

All ranks of a node share the node's one beton-serve daemon (started by hand, by systemd or a
Kubernetes DaemonSet, or auto-spawned by the first Loader).
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:  # Lightning 2.x, then the older package name; neither is required to import this module.
    from lightning.pytorch import LightningDataModule as _Base
except ImportError:
    try:
        from pytorch_lightning import LightningDataModule as _Base
    except ImportError:
        _Base = object

HAVE_LIGHTNING = _Base is not object

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406]) * 255
IMAGENET_STD = np.array([0.229, 0.224, 0.225]) * 255


class BetonDataModule(_Base):  # type: ignore[misc,valid-type]
    """Train and validation loaders over ``.beton`` files, decoded by a beton-serve daemon.

    Args:
        train_path: the training ``.beton`` (fields ``image``: RGB, ``label``: int).
        val_path: the validation ``.beton``, or ``None``.
        batch_size: per rank.
        res: training crop and validation size, in pixels.
        server: daemon address (``unix:///path.sock``, ``host:port`` or a list of those);
            ``None``: ``BETON_SERVE_ADDRESS``, then the per-user default socket.
        seed: the order and augmentation seed (the same seed gives the same batches).
        distributed: split each epoch over the ranks of ``torch.distributed``.
    """

    def __init__(
        self,
        train_path: str,
        val_path: str | None = None,
        *,
        batch_size: int = 256,
        res: int = 224,
        server: str | list[str] | None = None,
        seed: int = 0,
        distributed: bool = True,
    ) -> None:
        super().__init__()
        self.train_path = train_path
        self.val_path = val_path
        self.batch_size = batch_size
        self.res = res
        self.server = server
        self.seed = seed
        self.distributed = distributed

    def _device(self) -> Any:
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _is_distributed(self) -> bool:
        import torch.distributed as dist

        return self.distributed and dist.is_available() and dist.is_initialized()

    def train_dataloader(self) -> Any:
        """The training loader: random-resized crops and flips, decoded by the daemon."""
        from beton_client import Loader, OrderOption, ServeOptions
        from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
        from beton_serve.transforms import (
            NormalizeImage,
            RandomHorizontalFlip,
            Squeeze,
            ToDevice,
            ToTensor,
            ToTorchImage,
        )

        device = self._device()
        return Loader(
            self.train_path,
            batch_size=self.batch_size,
            order=OrderOption.RANDOM,
            distributed=self._is_distributed(),
            seed=self.seed,
            drop_last=True,
            serve=ServeOptions(server=self.server),
            pipelines={
                "image": [
                    RandomResizedCropRGBImageDecoder((self.res, self.res)),
                    RandomHorizontalFlip(),
                    ToTensor(),
                    ToDevice(device, non_blocking=True),
                    ToTorchImage(),
                    NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float32),
                ],
                "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device)],
            },
        )

    def val_dataloader(self) -> Any:
        """The validation loader: center crops, in file order; ``[]`` without a val file."""
        if self.val_path is None:
            return []
        from beton_client import Loader, OrderOption, ServeOptions
        from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
        from beton_serve.transforms import NormalizeImage, Squeeze, ToDevice, ToTensor, ToTorchImage

        device = self._device()
        return Loader(
            self.val_path,
            batch_size=self.batch_size,
            order=OrderOption.SEQUENTIAL,
            distributed=self._is_distributed(),
            drop_last=False,
            serve=ServeOptions(server=self.server),
            pipelines={
                "image": [
                    CenterCropRGBImageDecoder((self.res, self.res), ratio=224 / 256),
                    ToTensor(),
                    ToDevice(device, non_blocking=True),
                    ToTorchImage(),
                    NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float32),
                ],
                "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device)],
            },
        )
