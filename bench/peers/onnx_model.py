#!/usr/bin/env python3
"""The peer of `tensorport model-bench --model MODEL.onnx`: the same ONNX file in onnxruntime's
Python API, on batches of random images already in memory, the scores back after each batch,
printing the same table (batch, engine, precision, ms per batch, images/s) for the same batch
sizes.

usage: onnx_model.py MODEL.onnx [--batch 32,256] [--seconds 3] [--provider cpu|cuda]
                     [--image-size S] [--threads N] [--settings defaults|best] [--cuda-graph]

--settings (CUDA): onnxruntime's own defaults (TF32 on, exhaustive convolution search), or
"best" (the default): those with NHWC and the largest convolution workspace.
--cuda-graph (CUDA): the CUDA execution provider's `enable_cuda_graph` as well: a session per
batch size, its input and its scores bound at fixed places on the GPU (as CUDA graphs need),
the graph captured in the warm-up runs and replayed after; the scores copied to the host each
batch as without it. Whether CUDA graphs pay on a network: this row beside the one without.

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
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture the run as a CUDA graph and replay it (CUDA only)")
    a = ap.parse_args()
    if a.cuda_graph and a.provider != "cuda":
        ap.error("--cuda-graph needs --provider cuda")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = a.threads
    best = {"prefer_nhwc": 1, "cudnn_conv_use_max_workspace": 1,
            "cudnn_conv_algo_search": "EXHAUSTIVE", "use_tf32": 1}
    cuda_options = dict(best if a.settings == "best" else {})
    if a.cuda_graph:
        cuda_options["enable_cuda_graph"] = 1
    cuda = ("CUDAExecutionProvider", cuda_options)
    providers = [cuda] if a.provider == "cuda" else ["CPUExecutionProvider"]

    def session():
        return ort.InferenceSession(a.model, so, providers=providers)

    s = session()
    inp, out = s.get_inputs()[0], s.get_outputs()[0]
    side = inp.shape[2] if isinstance(inp.shape[2], int) else a.image_size
    dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
    precision = "f16" if dtype == np.float16 else "f32"
    engine = f"onnxruntime-python {a.provider}" + (
        f" ({a.settings}{', CUDA graph' if a.cuda_graph else ''})" if a.provider == "cuda" else "")
    classes = out.shape[-1]
    if a.cuda_graph and not isinstance(classes, int):
        raise SystemExit(f"--cuda-graph: the model's output {out.shape} leaves its last side open")
    print(f"{a.model}: 3x{side}x{side}, on {a.provider} (onnxruntime {ort.__version__}); "
          "scores to the host after each batch")
    print("| batch | engine | precision | ms per batch | images/s |")
    print("| ---: | --- | --- | ---: | ---: |")
    rng = np.random.default_rng(0)
    out_dtype = np.float16 if out.type == "tensor(float16)" else np.float32
    for i, b in enumerate(int(x) for x in a.batch.split(",")):
        x = rng.standard_normal((b, 3, side, side)).astype(dtype)
        if a.cuda_graph:
            # A graph replays the device addresses it captured: one session per batch size,
            # the input and the scores at fixed places on the GPU.
            sb = s if i == 0 else session()
            binding = sb.io_binding()
            xd = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
            yd = ort.OrtValue.ortvalue_from_shape_and_type((b, classes), out_dtype, "cuda", 0)
            binding.bind_ortvalue_input(inp.name, xd)
            binding.bind_ortvalue_output(out.name, yd)

            def run():
                sb.run_with_iobinding(binding)
                return yd.numpy()
        elif a.provider == "cuda":
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
