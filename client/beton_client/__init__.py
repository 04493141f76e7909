"""beton_client: the trainer-side Loader of beton-serve.

``from beton_client import Loader, OrderOption`` replaces ``from ffcv.loader import Loader,
OrderOption``. Importing this package never imports numba, cv2 or torch.
"""

from __future__ import annotations

__all__: list[str] = []
