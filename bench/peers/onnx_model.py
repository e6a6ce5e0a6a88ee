#!/usr/bin/env python3
"""The peer of `tensorport model-bench --model MODEL.onnx`: the same ONNX file in onnxruntime's
Python API, on batches of random images already in memory, the scores back after each batch,
printing the same table (batch, engine, precision, ms per batch, images/s) for the same batch
sizes.

usage: onnx_model.py MODEL.onnx [--batch 32,256] [--seconds 3] [--provider cpu|cuda]
                     [--image-size S] [--threads N] [--settings defaults|best]

--settings (CUDA): onnxruntime's own defaults (TF32 on, exhaustive convolution search), or
"best" (the default): those with NHWC and the largest convolution workspace.

Needs numpy and onnxruntime (onnxruntime-gpu for --provider cuda; the batch is then bound on
the GPU with I/O binding, so only the scores cross to the host).
"""
import argparse
import time

import numpy as np
import onnxruntime as ort


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", default="32,256")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--image-size", type=int, default=224,
                    help="where the model leaves the image sides open")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: one per core)")
    ap.add_argument("--settings", choices=["defaults", "best"], default="best")
    a = ap.parse_args()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = a.threads
    best = {"prefer_nhwc": 1, "cudnn_conv_use_max_workspace": 1,
            "cudnn_conv_algo_search": "EXHAUSTIVE", "use_tf32": 1}
    cuda = ("CUDAExecutionProvider", best if a.settings == "best" else {})
    providers = [cuda] if a.provider == "cuda" else ["CPUExecutionProvider"]
    s = ort.InferenceSession(a.model, so, providers=providers)
    inp, out = s.get_inputs()[0], s.get_outputs()[0]
    side = inp.shape[2] if isinstance(inp.shape[2], int) else a.image_size
    dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
    precision = "f16" if dtype == np.float16 else "f32"
    engine = f"onnxruntime-python {a.provider}" + (f" ({a.settings})" if a.provider == "cuda" else "")
    print(f"{a.model}: 3x{side}x{side}, on {a.provider} (onnxruntime {ort.__version__}); "
          "scores to the host after each batch")
    print("| batch | engine | precision | ms per batch | images/s |")
    print("| ---: | --- | --- | ---: | ---: |")
    rng = np.random.default_rng(0)
    for b in [int(x) for x in a.batch.split(",")]:
        x = rng.standard_normal((b, 3, side, side)).astype(dtype)
        if a.provider == "cuda":
            binding = s.io_binding()
            xd = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
            binding.bind_ortvalue_input(inp.name, xd)
            binding.bind_output(out.name, "cpu")

            def run():
                s.run_with_iobinding(binding)
                return binding.copy_outputs_to_cpu()[0]
        else:
            def run():
                return s.run([out.name], {inp.name: x})[0]
        for _ in range(3):
            run()
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < a.seconds:
            y = run()
            assert y.shape[0] == b
            n += 1
        secs = time.perf_counter() - t
        print(f"| {b} | {engine} | {precision} | {secs * 1e3 / n:.2f} | {n * b / secs:.0f} |")


if __name__ == "__main__":
    main()
