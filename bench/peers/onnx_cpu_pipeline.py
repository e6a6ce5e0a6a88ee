#!/usr/bin/env python3
"""The peer of `tensorport farm --model MODEL.onnx` on the CPU, as a Python user without PyTorch
builds it: a pool of worker processes decodes and transforms the JPEGs with Pillow (shorter side
to 256, bilinear, centre crop 224, ImageNet mean and standard deviation, CHW float32) while the
main process runs the ONNX file in onnxruntime's CPU execution provider on batches of --batch,
the scores on the host. images/s after the first batch until the last batch's scores; with
--alone, first the model alone on a resident batch (after one warm-up run).

    python3 bench/peers/onnx_cpu_pipeline.py LIST MODEL.onnx [--workers 1,2] [--batch 32]
                                             [--threads N] [--alone]

LIST names the files, one per line (the list the farm is given). Needs numpy, pillow and
onnxruntime.
"""
import argparse
import multiprocessing
import os
import time

import numpy as np

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def load(path):
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        s = 256 / min(w, h)
        im = im.resize((max(224, round(w * s)), max(224, round(h * s))), Image.BILINEAR)
        w, h = im.size
        left, top = (w - 224) // 2, (h - 224) // 2
        im = im.crop((left, top, left + 224, top + 224))
        x = np.asarray(im, np.float32).transpose(2, 0, 1) / 255.0
    return (x - MEAN) / STD


def session(model, threads):
    import onnxruntime as ort

    o = ort.SessionOptions()
    if threads:
        o.intra_op_num_threads = threads
    return ort.InferenceSession(model, o, providers=["CPUExecutionProvider"])


def alone(sess, batch, seconds=5.0):
    name = sess.get_inputs()[0].name
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    sess.run(None, {name: x})
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        sess.run(None, {name: x})
        n += batch
    return n / (time.perf_counter() - t)


def pipeline(sess, files, batch, workers):
    name = sess.get_inputs()[0].name
    done, t0, first = 0, None, 0
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        rows = []
        for x in pool.imap(load, files, chunksize=4):
            rows.append(x)
            if len(rows) == batch or done + len(rows) == len(files):
                scores = sess.run(None, {name: np.stack(rows)})[0]
                assert scores.shape[0] == len(rows)
                done += len(rows)
                rows = []
                if t0 is None:
                    t0, first = time.perf_counter(), done
    return (done - first) / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("list")
    ap.add_argument("model")
    ap.add_argument("--workers", default=str(os.cpu_count()), help="pool sizes, a row each")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime's intra-op threads (0: its default)")
    ap.add_argument("--alone", action="store_true")
    a = ap.parse_args()
    files = [line.rstrip("\n") for line in open(a.list) if line.strip()]
    sess = session(a.model, a.threads)
    if a.alone:
        print(f"onnxruntime alone, batch {a.batch}: {alone(sess, a.batch):.1f} images/s", flush=True)
    for w in a.workers.split(","):
        if int(w) < 1:
            continue
        r = pipeline(sess, files, a.batch, int(w))
        print(f"pillow {w} workers -> onnxruntime, batch {a.batch}, {len(files)} files: "
              f"{r:.1f} images/s after the first batch", flush=True)


if __name__ == "__main__":
    main()
