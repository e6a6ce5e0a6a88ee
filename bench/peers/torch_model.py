#!/usr/bin/env python3
"""The peer of `tensorport model-bench --device cuda`: the bundled classifier's architecture
(docs/model.md) in PyTorch eager mode, on batches already on the GPU, printing the same table
(batch, engine, precision, ms per batch, images/s) for the same batch sizes.

Rows, for each batch size:
  - torch NCHW / torch channels_last, f32 with TF32 off, then tf32 (TF32 on), bf16 and f16
    (torch.autocast): the scores copied to the host after every batch, as a server must
    before it answers (and as model-bench does);
  - the same f32 NCHW run "pipelined": batches launched back to back, one synchronisation at
    the end (no answer per batch) — PyTorch's best case.

usage: torch_model.py [--batch 32,256] [--seconds 3] [--width 16] [--classes 10] [--size 224]
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Classifier(nn.Module):
    """stem 4x4/4 -> 2 residual 3x3 -> down 2x2/2 -> 2 residual 3x3 -> mean -> linear."""

    def __init__(self, width, classes):
        super().__init__()
        w, w2 = width, 2 * width
        self.stem = nn.Conv2d(3, w, kernel_size=4, stride=4)
        self.res1 = nn.ModuleList(nn.Conv2d(w, w, 3, padding=1) for _ in range(2))
        self.down = nn.Conv2d(w, w2, kernel_size=2, stride=2)
        self.res2 = nn.ModuleList(nn.Conv2d(w2, w2, 3, padding=1) for _ in range(2))
        self.head = nn.Linear(w2, classes)

    @staticmethod
    def block(convs, x):
        return F.relu(x + convs[1](F.relu(convs[0](x))))

    def forward(self, x):
        x = self.block(self.res1, F.relu(self.stem(x)))
        x = self.block(self.res2, F.relu(self.down(x)))
        return self.head(x.mean(dim=(2, 3)))


def measure(step, seconds, batch, sync_each):
    """images/s and ms per batch of `step` after three warm-up batches."""
    for _ in range(3):
        step().cpu()
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        y = step()
        if sync_each:
            y.cpu()
        n += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return dt * 1e3 / n, n * batch / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="32,256", help="batch sizes, comma-separated")
    ap.add_argument("--seconds", type=float, default=3.0, help="measuring time per row")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--size", type=int, default=224)
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    net = Classifier(a.width, a.classes).cuda().eval()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}; "
          f"model 3x{a.size}x{a.size}, width {a.width}, {a.classes} classes")
    print("| batch | engine | precision | ms per batch | images/s |")
    print("| ---: | --- | --- | ---: | ---: |")
    for batch in (int(b) for b in a.batch.split(",")):
        x = torch.randn(batch, 3, a.size, a.size, device="cuda")
        for fmt, layout in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "channels_last")):
            n = net.to(memory_format=fmt)
            xx = x.contiguous(memory_format=fmt)
            for precision in ("f32", "tf32", "bf16", "f16"):
                tf32 = precision == "tf32"
                torch.backends.cuda.matmul.allow_tf32 = tf32
                torch.backends.cudnn.allow_tf32 = tf32
                dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(precision)

                def step():
                    with torch.inference_mode(), torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                        return n(xx)

                ms, ips = measure(step, a.seconds, batch, sync_each=True)
                print(f"| {batch} | torch {layout} | {precision} | {ms:.2f} | {ips:.0f} |", flush=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        n = net.to(memory_format=torch.contiguous_format)

        def step():
            with torch.inference_mode():
                return n(x)

        ms, ips = measure(step, a.seconds, batch, sync_each=False)
        print(f"| {batch} | torch NCHW, pipelined | f32 | {ms:.2f} | {ips:.0f} |", flush=True)


if __name__ == "__main__":
    main()
