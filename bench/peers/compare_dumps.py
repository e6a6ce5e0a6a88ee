#!/usr/bin/env python3
"""Compare two of tensorport's tensor dumps file by file (numpy only, no torch).

    tensorport prep --input DIR --dump a.safetensors --coarse-progressive off
    tensorport prep --input DIR --dump b.safetensors
    python3 bench/peers/compare_dumps.py a.safetensors b.safetensors

Prints the files whose tensors differ, each with its mean and largest absolute difference, then
how many differ, the worst file's mean and the largest difference over all.
"""
import json
import struct
import sys

import numpy as np


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            sys.exit(f"{path}: {name} is {t['dtype']}, not F32")
        start, end = t["data_offsets"]
        out[name] = np.frombuffer(raw[base + start:base + end], dtype=np.float32).reshape(t["shape"])
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = load(sys.argv[1]), load(sys.argv[2])
    common = sorted(set(a) & set(b))
    if not common:
        sys.exit("no file names in common")
    changed, worst_mean, largest = 0, 0.0, 0.0
    for name in common:
        if a[name].shape != b[name].shape:
            sys.exit(f"{name}: shapes differ: {a[name].shape} vs {b[name].shape}")
        d = np.abs(a[name] - b[name])
        if d.max() > 0:
            changed += 1
            print(f"{name}: mean {d.mean():.4f}, largest {d.max():.4f}")
        worst_mean, largest = max(worst_mean, float(d.mean())), max(largest, float(d.max()))
    print(f"{changed} of {len(common)} files differ; worst file's mean {worst_mean:.4f}, "
          f"largest {largest:.4f}")


if __name__ == "__main__":
    main()
