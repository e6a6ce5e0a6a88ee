#!/usr/bin/env python3
"""NVIDIA DALI's way of turning a folder of JPEGs into normalised batches: the peer of
`tensorport farm --input DIR` beside bench/peers/torch_jpeg.py.

The same standard ImageNet evaluation transform -- decode to RGB, resize the shorter side to 256
(linear, antialiased), centre-crop 224x224, subtract the ImageNet mean and divide by its standard
deviation (on 0-255 values, as [0, 1] scaled) -- giving float32 [3, 224, 224] per image, in
batches of --batch (32; several sizes give a row each):

  mixed   fn.decoders.image(device="mixed"): DALI splits each batch between the GPU's hardware
          JPEG decoder (hw_decoder_load of it) and nvJPEG's CUDA decoder, with the Huffman stage
          on the host threads; resize, crop and normalise on the GPU. One row per --hw-load.
  cpu     fn.decoders.image(device="cpu") and every later step on the host threads.

Files come from fn.readers.file (DALI reads them itself). images/s counts the images after the
first batch, over one pass of the folder.

    python3 bench/peers/dali_jpeg.py DIR [--pipelines mixed,cpu] [--threads 15]
                                     [--hw-load 0.9,0.65] [--limit N] [--batch 128,32]
                                     [--repeat N]

--repeat lists the folder N times over (as the farm's benchmarks list theirs).

Needs `pip install nvidia-dali-cuda130` (it brings nvidia-nvimgcodec-cu13); `cpu` runs without a
GPU (device_id=None).
"""
import argparse
import os
import time

from nvidia.dali import fn, pipeline_def, types

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


@pipeline_def
def transform(files, decoder, hw_load):
    jpegs, _ = fn.readers.file(files=files, name="reader", pad_last_batch=True)
    if decoder == "mixed":
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB, hw_decoder_load=hw_load)
    else:
        images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
    images = fn.resize(images, resize_shorter=256, antialias=True, interp_type=types.INTERP_LINEAR)
    return fn.crop_mirror_normalize(images, crop=(224, 224), dtype=types.FLOAT, output_layout="CHW",
                                    mean=MEAN, std=STD)


def run(files, decoder, threads, hw_load, batch):
    """images/s after the first batch over one pass of `files`, and the batch's shape."""
    pipe = transform(files, decoder, hw_load, batch_size=batch, num_threads=threads,
                     device_id=0 if decoder == "mixed" else None, prefetch_queue_depth=2)
    pipe.build()
    batches = -(-len(files) // batch)
    (out,) = pipe.run()
    shape = tuple(out.as_tensor().shape())
    t = time.perf_counter()
    for _ in range(batches - 1):
        (out,) = pipe.run()
    out.as_tensor()  # the last batch is done (on the GPU: waits for it)
    dt = time.perf_counter() - t
    done = len(files) - min(batch, len(files))
    return (done / dt if dt > 0 else float("nan")), shape


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--pipelines", default="mixed,cpu")
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--hw-load", default="0.9,0.65", help="hw_decoder_load values for `mixed`")
    ap.add_argument("--limit", type=int, default=0, help="only the first N files (by name)")
    ap.add_argument("--batch", default="32", help="batch sizes, a row each")
    ap.add_argument("--repeat", type=int, default=1, help="the folder listed N times over")
    a = ap.parse_args()
    files = sorted(os.path.join(a.dir, f) for f in os.listdir(a.dir)
                   if f.lower().endswith((".jpg", ".jpeg")))
    if a.limit:
        files = files[:a.limit]
    files = files * max(1, a.repeat)
    sizes = [int(b) for b in a.batch.split(",")]
    if len(files) < 2 * max(sizes):
        raise SystemExit(f"{a.dir}: {len(files)} JPEG files; the measurement needs at least {2 * max(sizes)}")
    print(f"{len(files)} files, batches of {a.batch}, {a.threads} threads")
    for p in a.pipelines.split(","):
        loads = [float(x) for x in a.hw_load.split(",")] if p == "mixed" else [0.0]
        for load, batch in ((l, b) for l in loads for b in sizes):
            ips, shape = run(files, p, a.threads, load, batch)
            what = f"dali {p}" + (f", hw_decoder_load {load}" if p == "mixed" else "")
            print(f"{what}: {ips:.0f} images/s after the first batch (batch {shape})", flush=True)


if __name__ == "__main__":
    main()
