#!/usr/bin/env python3
"""A real network fed from a folder of JPEGs in Python: torchvision's ResNet-50 (random weights,
bf16, channels_last, batch 128, eager) alone on a resident batch, then fed by

  loader            tensorport.Loader(files, device="cuda", batch_size=128): its defaults (the
                    farm's producer mix, batches gathered ahead, `prefetch=2`)
  loader-prefetch0  the same with prefetch=0 (each batch gathered when asked for)
  loader-gpu2       an explicit mix: 2 GPU producers, no CPU producer
  loader-gpu3       3 GPU producers, no CPU producer
  loader-gpu1       14 CPU producers and 1 GPU producer (less of the images prepared on the GPU)
  loader-prefetch4  the defaults with prefetch=4
  dali              NVIDIA DALI's mixed pipeline (bench/peers/onnx_pipelines.py's)
  dataloader        torch's DataLoader, 15 workers, pinned (the same script's)

Each loop is what an inference script does: the batch into the network, the scores to the host
(one synchronisation a batch). images/s after the first batch; the model alone counts 20
(`--alone-batches`) batches after 3 of warm-up. Each fed run also gives the loop's mean wait
for a batch and its mean time in the step; `--no-model` measures the pipelines alone (each
batch's GPU work waited for, no network).

    python3 bench/peers/loader_resnet.py LIST [--pipelines loader,dali] [--binary PATH]
                                           [--mps auto|on|off] [--hw-load 0.9] [--no-model]

The Loaders are made before the network touches the GPU (CUDA joins MPS only as it starts in
a process), as docs/python.md tells users to.

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


def alone(model, batch, count=20):
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    for _ in range(3):
        step(model, x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(count):
        step(model, x)
    return count * batch / (time.perf_counter() - t)


def rate(batches, model, n):
    """images/s after the first batch, and the loop's mean milliseconds a batch spent waiting
    for the pipeline and in the network's step. Without a model (`None`) the step only waits
    for the batch's work on the GPU: the pipeline's own rate."""
    it = iter(batches)
    first = next(it)
    if model is not None:
        step(model, first)
    done, t = 0, time.perf_counter()
    waited = stepped = 0.0
    count = 0
    while True:
        t0 = time.perf_counter()
        try:
            x = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        if model is None:
            torch.cuda.current_stream().synchronize()
        else:
            y = step(model, x)
            assert y.shape[0] == x.shape[0]
        waited += t1 - t0
        stepped += time.perf_counter() - t1
        count += 1
        done += x.shape[0]
    dt = time.perf_counter() - t
    assert done == n - first.shape[0], (done, n)
    return done / dt, 1e3 * waited / max(count, 1), 1e3 * stepped / max(count, 1)


def make_loader(files, batch, binary, **kw):
    import tensorport

    loader = tensorport.Loader(files, batch_size=batch, device="cuda", binary=binary, **kw)
    print(f"  Loader: {loader.producers} CPU and {loader.gpu_producers} GPU producers"
          f" (mps={loader.mps})", flush=True)
    return loader


def loader_batches(loader):
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
    ap.add_argument("--hw-load", default="0.9",
                    help="DALI's hw_decoder_load; a comma-separated list runs `dali` per value")
    ap.add_argument("--mps", default="auto", choices=["auto", "on", "off"],
                    help="the Loaders' mps= (they are made before the model touches the GPU)")
    ap.add_argument("--alone-batches", type=int, default=20,
                    help="batches the model alone is timed over (after 3 of warm-up)")
    ap.add_argument("--no-model", action="store_true",
                    help="the pipelines alone: each batch waited for on the GPU, no network")
    a = ap.parse_args()
    files = [line.rstrip("\n") for line in open(a.list) if line.strip()]
    pipelines = [p for p in a.pipelines.split(",") if p]  # "": the model alone
    # The Loaders first, as docs/python.md says: CUDA joins MPS only as it starts in a process.
    kw = {"loader": {}, "loader-prefetch0": {"prefetch": 0},
          "loader-gpu2": {"producers": 0, "gpu_producers": 2},
          "loader-gpu3": {"producers": 0, "gpu_producers": 3}, "loader-prefetch4": {"prefetch": 4},
          "loader-gpu1": {"producers": 14, "gpu_producers": 1}}
    loaders = {p: make_loader(files, a.batch, a.binary, mps=a.mps, **kw[p])
               for p in pipelines if p in kw}
    model = None if a.no_model else network()
    print(f"{len(files)} files, batch {a.batch}, "
          f"{'no network' if model is None else 'ResNet-50 bf16 channels_last'} "
          f"({torch.cuda.get_device_name()})", flush=True)
    if model is not None:
        r = alone(model, a.batch, a.alone_batches)
        print(f"alone: {r:.0f} images/s ({1e3 * a.batch / r:.2f} ms a batch)", flush=True)
    runs = [(p, load) for p in pipelines
            for load in (a.hw_load.split(",") if p == "dali" else [None])]
    for p, load in runs:
        if p in loaders:
            batches = loader_batches(loaders[p])
        elif p == "dali":
            batches = dali_batches(files, a.batch, a.threads, float(load))
        else:
            batches = dataloader_batches(files, a.batch, a.workers)
        name = p if load is None else f"{p} (hw_decoder_load {load})"
        r, waited, stepped = rate(batches, model, len(files))
        print(f"{name}: {r:.0f} images/s after the first batch (a batch: {waited:.2f} ms "
              f"waited for, {stepped:.2f} ms in the step)", flush=True)


if __name__ == "__main__":
    main()
