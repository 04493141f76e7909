"""The served side of ``beton-serve bench``: a client process that iterates a daemon's stream.

``beton-serve bench`` runs this module as a separate process, standing for a trainer; it talks
to the daemon only through ``beton_client`` and is never imported by the rest of
``beton_serve``. It prints one ``.`` line per batch (the parent's progress bar) and, at the end,
one JSON line: ``{"epoch_times", "epoch_images", "batches_per_epoch", "cpu_s", "transport"}``,
where ``cpu_s`` is this process's CPU time over all epochs (the trainer's own cost of receiving).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="beton-serve bench client")
    p.add_argument("dataset")
    p.add_argument("--server", required=True)
    p.add_argument("--pipeline", default="decode")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--order", default="RANDOM")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from beton_client import Loader, OrderOption, ServeOptions

    from beton_serve.cli._bench import build_pipelines
    from beton_serve.format import BetonReader

    with BetonReader(args.dataset) as reader:
        pipelines = build_pipelines(reader, args.pipeline, args.res)
    loader = Loader(
        args.dataset,
        batch_size=args.batch_size,
        order=OrderOption[args.order],
        seed=args.seed,
        pipelines=pipelines,
        drop_last=False,
        serve=ServeOptions(server=args.server, spawn=False),
    )
    out = sys.stdout
    times: list[float] = []
    counts: list[int] = []
    cpu0 = time.process_time()
    for _ in range(args.epochs):
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += len(batch[0])
            out.write(".\n")
            out.flush()
        times.append(time.perf_counter() - t0)
        counts.append(n)
    cpu = time.process_time() - cpu0
    transport = getattr(loader, "chosen_transport", None)
    batches_per_epoch = len(loader)
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    result = {
        "epoch_times": times,
        "epoch_images": counts,
        "batches_per_epoch": batches_per_epoch,
        "cpu_s": cpu,
        "transport": transport if isinstance(transport, str) else None,
    }
    out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
