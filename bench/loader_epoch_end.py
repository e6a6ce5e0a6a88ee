#!/usr/bin/env python3
"""Where a `tensorport.Loader` epoch's time goes around its batches: from the iteration's start
to the first batch, from the first batch to the last (the rate), and from the last batch to the
end of the iteration (`StopIteration`: what the caller still waits for once every image is
out). No network: each batch is only waited for (on a GPU, its stream synchronised).

    python3 bench/loader_epoch_end.py LIST [--device cuda] [--batch 128] [--producers N]
                                          [--image-size 224] [--repeat 1] [--epochs 2]

LIST names the files, one per line (a folder is listed too); `--repeat` lists them that many
times. Needs the package (PYTHONPATH), numpy; torch and the CUDA build of the binary
(TENSORPORT_BIN) for `--device cuda`.
"""
import argparse
import os
import time

import tensorport


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("list")
    ap.add_argument("--device", default=None, help="cuda for batches on the GPU")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--producers", type=int, default=None,
                    help="CPU producers (default: the Loader's own choice)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()
    if os.path.isdir(a.list):
        files = sorted(os.path.join(a.list, f) for f in os.listdir(a.list))
    else:
        files = [line.rstrip("\n") for line in open(a.list) if line.strip()]
    files *= a.repeat
    kw = {"batch_size": a.batch, "image_size": a.image_size}
    if a.device:
        kw["device"] = a.device
    if a.producers is not None:
        kw["producers"] = a.producers
    loader = tensorport.Loader(files, **kw)
    if a.device:
        import torch

        def wait():
            torch.cuda.current_stream().synchronize()
    else:
        def wait():
            pass
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        n, first, last = 0, None, None
        for x, _ in loader:
            wait()
            n += len(x)
            now = time.perf_counter()
            first = first or now
            last = now
        end = time.perf_counter()
        rate = (n - a.batch) / (last - first) if last > first else float("nan")
        print(f"epoch {epoch}: {n} images; first batch after {first - t0:.3f} s; first to last "
              f"{last - first:.3f} s ({rate:.0f} images/s); last batch to the end "
              f"{end - last:.3f} s", flush=True)


if __name__ == "__main__":
    main()
