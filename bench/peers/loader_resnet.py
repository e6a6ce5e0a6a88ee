#!/usr/bin/env python3
"""A real network fed from a folder of JPEGs in Python: torchvision's ResNet-50 (random weights,
bf16, channels_last, batch 128, eager) alone on a resident batch, then fed by

  loader            tensorport.Loader(files, device="cuda", batch_size=128): its defaults (the
                    farm's producer mix, batches gathered ahead, `prefetch=2`)
  loader-prefetch0  the same with prefetch=0 (each batch gathered when asked for)
  loader-gpu2       an explicit mix: 2 GPU producers, no CPU producer
  dali              NVIDIA DALI's mixed pipeline (bench/peers/onnx_pipelines.py's)
  dataloader        torch's DataLoader, 15 workers, pinned (the same script's)

Each loop is what an inference script does: the batch into the network, the scores to the host
(one synchronisation a batch). images/s after the first batch; the model alone counts 20
batches after 3 of warm-up.

    python3 bench/peers/loader_resnet.py LIST [--pipelines loader,dali] [--binary PATH]

LIST names the files, one per line. Needs torch, torchvision, the package (PYTHONPATH) with the
CUDA build of the binary (--binary or TENSORPORT_BIN), and nvidia-dali-cuda130 for `dali`.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from onnx_pipelines import dali_batches, dataloader_batches  # noqa: E402


def network():
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.resnet50().eval().cuda()
    return m.to(torch.bfloat16).to(memory_format=torch.channels_last)


@torch.no_grad()
def step(model, x):
    x = x.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    return model(x).float().cpu()


def alone(model, batch):
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    for _ in range(3):
        step(model, x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        step(model, x)
    return 20 * batch / (time.perf_counter() - t)


def rate(batches, model, n):
    it = iter(batches)
    first = next(it)
    step(model, first)
    done, t = 0, time.perf_counter()
    for x in it:
        y = step(model, x)
        assert y.shape[0] == x.shape[0]
        done += x.shape[0]
    dt = time.perf_counter() - t
    assert done == n - first.shape[0], (done, n)
    return done / dt


def loader_batches(files, batch, binary, **kw):
    import tensorport

    loader = tensorport.Loader(files, batch_size=batch, device="cuda", binary=binary, **kw)
    print(f"  Loader: {loader.producers} CPU and {loader.gpu_producers} GPU producers",
          flush=True)
    for x, _ in loader:
        yield x


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("list")
    ap.add_argument("--pipelines", default="loader,loader-prefetch0,loader-gpu2,dali,dataloader")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--binary", default=os.environ.get("TENSORPORT_BIN"))
    ap.add_argument("--workers", type=int, default=15, help="DataLoader worker processes")
    ap.add_argument("--threads", type=int, default=15, help="DALI's CPU threads")
    a = ap.parse_args()
    files = [line.rstrip("\n") for line in open(a.list) if line.strip()]
    model = network()
    print(f"{len(files)} files, batch {a.batch}, ResNet-50 bf16 channels_last "
          f"({torch.cuda.get_device_name()})", flush=True)
    print(f"alone: {alone(model, a.batch):.0f} images/s", flush=True)
    for p in a.pipelines.split(","):
        if p == "loader":
            batches = loader_batches(files, a.batch, a.binary)
        elif p == "loader-prefetch0":
            batches = loader_batches(files, a.batch, a.binary, prefetch=0)
        elif p == "loader-gpu2":
            batches = loader_batches(files, a.batch, a.binary, producers=0, gpu_producers=2)
        elif p == "dali":
            batches = dali_batches(files, a.batch, a.threads)
        else:
            batches = dataloader_batches(files, a.batch, a.workers)
        print(f"{p}: {rate(batches, model, len(files)):.0f} images/s after the first batch",
              flush=True)


if __name__ == "__main__":
    main()
