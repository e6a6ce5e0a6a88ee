#!/usr/bin/env python3
"""torchvision's ResNet-50 alone in PyTorch, the peer of `tensorport model-bench --device cuda
--model resnet50.onnx` and bench/peers/onnx_model.py: the same network (seed 0, as
bench/peers/resnet50_onnx.py exports it) on batches already on the GPU, the scores copied to the
host after every batch (as a server must before it answers, and as model-bench does), in eager
mode and under torch.compile, f32 (TF32 off) and f16, channels_last. Prints the same table:
batch, engine, precision, ms per batch, images/s.

    python3 bench/peers/resnet50_torch.py [--batch 32,128,256] [--seconds 2]
                                          [--engines eager,compile] [--precisions f32,f16]
"""
import argparse
import time

import torch
import torchvision


def timed(step, seconds):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        step()
        n += 1
    return (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="32,128,256")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--engines", default="eager,compile")
    ap.add_argument("--precisions", default="f32,f16")
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    print(f"ResNet-50 in PyTorch {torch.__version__} on {torch.cuda.get_device_name()}")
    print("| batch | engine | precision | ms / batch | images/s |")
    print("| ---: | --- | --- | ---: | ---: |")
    for precision in a.precisions.split(","):
        dtype = torch.float16 if precision == "f16" else torch.float32
        torch.manual_seed(0)
        net = torchvision.models.resnet50().eval().cuda().to(dtype)
        net = net.to(memory_format=torch.channels_last)
        for engine in a.engines.split(","):
            model = torch.compile(net) if engine == "compile" else net
            for b in (int(x) for x in a.batch.split(",")):
                x = torch.randn(b, 3, 224, 224, device="cuda", dtype=dtype)
                x = x.contiguous(memory_format=torch.channels_last)

                @torch.no_grad()
                def step():
                    model(x).float().cpu()

                s = timed(step, a.seconds)
                print(f"| {b} | torch {engine} | {precision} | {s * 1e3:.2f} | {b / s:,.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
