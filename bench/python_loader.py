#!/usr/bin/env python3
"""`tensorport.Loader` (a farm of Rust producers feeding this Python process) delivering
ImageNet-transformed batches of 32 to the GPU: the peer of `bench/peers/torch_jpeg.py`'s
DataLoader pipelines on the same folder. Images/s after the first batch, as the peer counts.

    PYTHONPATH=<the package> python3 bench/python_loader.py DIR [--producers 8,15] [--binary PATH]
        [--gpu-producers 1] [--no-host]

With --gpu-producers N, also `Loader(device="cuda", gpu_producers=N)` (the CUDA build of the
binary): JPEGs decoded and prepared on the GPU, batches arriving as CUDA tensors; alone, and
with the largest --producers count of CPU producers beside them.
"""
import argparse
import os
import time

import torch

import tensorport


def rate(files, producers, binary, pin, **kw):
    loader = tensorport.Loader(files, batch_size=32, producers=producers, image_size=224,
                               binary=binary, torch=True, pin_memory=pin, **kw)
    batches = iter(loader)
    x, _ = next(batches)
    x.cuda(non_blocking=True)
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 0
    for x, _ in batches:
        x.cuda(non_blocking=True)
        n += len(x)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--producers", default="8,15")
    ap.add_argument("--binary")
    ap.add_argument("--gpu-producers", type=int, default=0)
    ap.add_argument("--no-host", action="store_true", help="skip the host-memory runs")
    a = ap.parse_args()
    files = sorted(os.path.join(a.dir, f) for f in os.listdir(a.dir)
                   if f.lower().endswith((".jpg", ".jpeg")))
    print(f"{len(files)} files; GPU: {torch.cuda.get_device_name()}", flush=True)
    counts = [int(x) for x in a.producers.split(",")]
    if a.gpu_producers:
        for p in (0, max(counts)):
            r = rate(files, p, a.binary, False, device="cuda", gpu_producers=a.gpu_producers)
            print(f"tensorport.Loader device=cuda gpu_producers={a.gpu_producers} producers={p}: "
                  f"{r:.0f} images/s (after the first batch)", flush=True)
    for pin in (False, True) if not a.no_host else ():
        for p in counts:
            r = rate(files, p, a.binary, pin)
            print(f"tensorport.Loader producers={p} pin_memory={pin}: {r:.0f} images/s "
                  "(after the first batch)", flush=True)


if __name__ == "__main__":
    main()
