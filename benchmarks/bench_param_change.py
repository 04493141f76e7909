"""Time to the first batch after an op parameter changes between epochs (progressive resizing),
in process: each change now builds a new plan (RESULTS.md, session 46).

Run: python benchmarks/bench_param_change.py [FILE]
"""

import sys
import time

from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader
from beton_serve.transforms import RandomHorizontalFlip, ToTensor

dec = RandomResizedCropRGBImageDecoder((32, 32))
FILE = sys.argv[1] if len(sys.argv) > 1 else "../shared/fixtures/ffcv/images_jpg.beton"
ld = Loader(
    FILE,
    batch_size=16,
    num_workers=2,
    pipelines={
        "image": [dec, RandomHorizontalFlip(), ToTensor()],
        "label": [IntDecoder(), ToTensor()],
    },
)
for _ in ld:
    pass
out = []
for res in [40, 48, 56, 64, 72, 80, 40]:
    dec.output_size = (res, res)
    t = time.perf_counter()
    it = iter(ld)
    b = next(it)
    t1 = time.perf_counter() - t
    for _ in it:
        pass
    assert b[0].shape[1] == res
    out.append(round(t1 * 1000, 1))
print("first batch after a size change (ms):", out)
ld.close()
