#!/usr/bin/env python3
"""PyTorch's DataLoader feeding a GPU: the peer of `tensorport farm --model none`.

Worker processes produce float32 [3, 224, 224] images, the DataLoader collates batches of 32,
pins them and copies each to the GPU (non_blocking). Two datasets:

  ready       the image is already made; each item is a copy of it (only the hand-off costs,
              like `farm --ready`)
  light       a light preprocessing step per item: u8 HWC 256x256 -> f32, bilinear resize to
              224x224, normalise

    python3 bench/peers/torch_loader.py [--workers 1,4,8,15] [--datasets ready,light]
                                        [--batches 300] [--json OUT]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

BATCH = 32
MEAN = torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1)
STD = torch.tensor((0.229, 0.224, 0.225)).view(3, 1, 1)


class Ready(Dataset):
    def __init__(self, n):
        self.n, self.img = n, torch.rand(3, 224, 224)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.img.clone()


class Light(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.n = n
        self.raw = [torch.randint(0, 256, (256, 256, 3), dtype=torch.uint8, generator=g)
                    for _ in range(16)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = self.raw[i % len(self.raw)].permute(2, 0, 1).float().div_(255)[None]
        x = F.interpolate(x, size=(224, 224), mode="bilinear", align_corners=False)[0]
        return (x - MEAN) / STD


def one_thread(_worker):
    torch.set_num_threads(1)


def rate(ds, workers):
    """(images/s, GB/s) delivered to the GPU after the first batch."""
    dl = DataLoader(ds, batch_size=BATCH, num_workers=workers, pin_memory=True,
                    prefetch_factor=4, worker_init_fn=one_thread)
    it = iter(dl)
    next(it).cuda(non_blocking=True)
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 0
    for b in it:
        b.cuda(non_blocking=True)
        n += len(b)
    torch.cuda.synchronize()
    secs = time.perf_counter() - start
    return n / secs, n * 3 * 224 * 224 * 4 / secs / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,4,8,15")
    ap.add_argument("--datasets", default="ready,light")
    ap.add_argument("--batches", type=int, default=300, help="batches per measurement [300]")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    out = {}
    for name in a.datasets.split(","):
        cls = {"ready": Ready, "light": Light}.get(name)
        if cls is None:
            ap.error(f"unknown dataset {name}")
        for w in (int(x) for x in a.workers.split(",")):
            ips, gbs = rate(cls(BATCH * (a.batches + 1)), w)
            out[f"{name} workers={w}"] = {"images_per_s": ips, "GB_per_s": gbs}
            print(f"DataLoader {name} workers={w}: {ips:.0f} images/s, {gbs:.2f} GB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
