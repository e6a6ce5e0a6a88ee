#!/usr/bin/env python3
"""PyTorch's ways of turning a folder of JPEGs into normalised batches on the GPU: the peer of
`tensorport farm --input DIR`.

Each pipeline applies the standard ImageNet evaluation transform -- decode to RGB, resize the
shorter side to 256 (bilinear, antialiased), centre-crop 224x224, scale to [0, 1], subtract the
ImageNet mean and divide by its standard deviation -- giving float32 [3, 224, 224] per image, and
delivers batches of 32 to the GPU:

  cpu-tv      torch DataLoader, N worker processes: torchvision.io.decode_jpeg + transforms.v2
  cpu-pil     torch DataLoader, N worker processes: PIL + the classic transforms
  gpu-nvjpeg  one process: torchvision.io.decode_jpeg(device="cuda") (nvJPEG) on batches of 32,
              resize/crop/normalise on the GPU (file reads done beforehand)

Workers run one thread each; DataLoader batches are pinned and copied with non_blocking=True.
Before the pipelines it times the torchvision path's stages on one core.

    python3 bench/peers/torch_jpeg.py DIR [--workers 1,8,15] [--pipelines cpu-tv,cpu-pil,gpu-nvjpeg]
                                     [--limit N] [--repeat K] [--json OUT] [--dump K OUT.pt]

--dump K OUT.pt saves torchvision's tensors for the first K files (by name) as
{file name: float32 [3,224,224]}, to check another implementation against.
"""
import argparse
import json
import os
import time

import torch
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
BATCH = 32

RESIZE_CROP = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])
NORMALISE = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def tv_transform(path):
    return NORMALISE(RESIZE_CROP(decode_jpeg(read_file(path), mode=ImageReadMode.RGB)))


class Files(Dataset):
    def __init__(self, files, fn):
        self.files, self.fn = files, fn

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.fn(self.files[i])


def pil_transform():
    from PIL import Image
    from torchvision import transforms as T
    t = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])

    def fn(path):
        with Image.open(path) as im:
            return t(im.convert("RGB"))
    return fn


def one_thread(_worker):
    torch.set_num_threads(1)


def loader_rate(files, fn, workers):
    """Images/s a DataLoader delivers to the GPU, after its first batch."""
    dl = DataLoader(Files(files, fn), batch_size=BATCH, num_workers=workers, pin_memory=True,
                    prefetch_factor=4, worker_init_fn=one_thread)
    batches = iter(dl)
    next(batches).cuda(non_blocking=True)
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 0
    for b in batches:
        b.cuda(non_blocking=True)
        n += len(b)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def nvjpeg_rate(files):
    encoded = [read_file(f) for f in files]
    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1)
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1)

    def batch(chunk):
        imgs = decode_jpeg(chunk, mode=ImageReadMode.RGB, device="cuda")
        x = torch.stack([RESIZE_CROP(im) for im in imgs]).float().div_(255)
        return (x - mean) / std
    batch(encoded[:BATCH])  # warm-up: nvJPEG handles, kernels
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 0
    for k in range(BATCH, len(encoded) - BATCH + 1, BATCH):
        batch(encoded[k:k + BATCH])
        n += BATCH
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def stages_one_core(files, k=200):
    """Microseconds per image for each stage of the torchvision path, one thread."""
    torch.set_num_threads(1)
    encoded = [read_file(f) for f in files[:k]]
    t0 = time.perf_counter()
    imgs = [decode_jpeg(e, mode=ImageReadMode.RGB) for e in encoded]
    t1 = time.perf_counter()
    cropped = [RESIZE_CROP(i) for i in imgs]
    t2 = time.perf_counter()
    for c in cropped:
        NORMALISE(c)
    t3 = time.perf_counter()
    n = len(encoded)
    return {"decode_us": (t1 - t0) / n * 1e6, "resize_crop_us": (t2 - t1) / n * 1e6,
            "normalise_us": (t3 - t2) / n * 1e6, "images_per_s": n / (t3 - t0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="folder of .jpg/.jpeg files")
    ap.add_argument("--workers", default="1,8,15", help="DataLoader worker counts [1,8,15]")
    ap.add_argument("--pipelines", default="cpu-tv,cpu-pil,gpu-nvjpeg",
                    help="comma-separated, or none (just the one-core stages and --dump)")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N files")
    ap.add_argument("--repeat", type=int, default=1,
                    help="list the files K times, as `farm --input-list` of a folder listed K times [1]")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--dump", nargs=2, metavar=("K", "OUT"), help="save reference tensors")
    a = ap.parse_args()
    files = sorted(os.path.join(a.dir, f) for f in os.listdir(a.dir)
                   if f.lower().endswith((".jpg", ".jpeg")))
    if a.limit:
        files = files[:a.limit]
    files = files * max(1, a.repeat)
    if len(files) < 2 * BATCH:
        ap.error(f"{a.dir} has {len(files)} JPEG files; give at least {2 * BATCH}")
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"{os.cpu_count()} CPUs, {torch.cuda.get_device_name()}, {len(files)} files", flush=True)
    out = {"files": len(files), "stages_one_core": stages_one_core(files)}
    print("torchvision on one core:",
          ", ".join(f"{k} {v:.1f}" for k, v in out["stages_one_core"].items()), flush=True)
    if a.dump:
        k = int(a.dump[0])
        torch.save({os.path.basename(f): tv_transform(f) for f in files[:k]}, a.dump[1])
        print(f"torchvision's tensors for the first {k} files in {a.dump[1]}", flush=True)
    for p in a.pipelines.split(","):
        if p == "none":
            continue
        if p == "gpu-nvjpeg":
            out[p] = nvjpeg_rate(files)
            print(f"{p}: {out[p]:.0f} images/s", flush=True)
            continue
        if p not in ("cpu-tv", "cpu-pil"):
            ap.error(f"unknown pipeline {p}")
        fn = tv_transform if p == "cpu-tv" else pil_transform()
        for w in (int(x) for x in a.workers.split(",")):
            key = f"{p} workers={w}"
            out[key] = loader_rate(files, fn, w)
            print(f"{key}: {out[key]:.0f} images/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
