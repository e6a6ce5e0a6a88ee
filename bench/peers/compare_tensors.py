#!/usr/bin/env python3
"""Compare tensorport's preprocessed tensors with torchvision's, file by file.

    tensorport prep --input DIR --limit 256 --dump ours.safetensors
    python3 bench/peers/torch_jpeg.py DIR --limit 256 --pipelines none --dump 256 ref.pt
    python3 bench/peers/compare_tensors.py ours.safetensors ref.pt [--mean 0.01] [--max 0.1]

Prints the mean and largest absolute difference over all values (after normalisation), the
worst files, and exits 1 if the mean or the largest difference is over its bound.
"""
import argparse
import sys

import torch
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ours", help="safetensors file from `tensorport prep --dump`")
    ap.add_argument("ref", help=".pt file from `torch_jpeg.py --dump`")
    ap.add_argument("--mean", type=float, default=0.01, help="bound on the mean |difference|")
    ap.add_argument("--max", type=float, default=0.1, help="bound on the largest |difference|")
    a = ap.parse_args()
    ours, ref = load_file(a.ours), torch.load(a.ref)
    common = sorted(set(ours) & set(ref))
    if not common:
        sys.exit(f"no file names in common between {a.ours} and {a.ref}")
    per_file, total, count, worst = [], 0.0, 0, 0.0
    for name in common:
        d = (ours[name].float() - ref[name].float()).abs()
        if d.shape != ours[name].shape or ours[name].shape != ref[name].shape:
            sys.exit(f"{name}: shapes differ: {tuple(ours[name].shape)} vs {tuple(ref[name].shape)}")
        total += d.sum().item()
        count += d.numel()
        worst = max(worst, d.max().item())
        per_file.append((d.mean().item(), d.max().item(), name))
    mean = total / count
    per_file.sort(reverse=True)
    print(f"{len(common)} files ({len(ours)} ours, {len(ref)} reference): "
          f"mean |diff| {mean:.5f}, max |diff| {worst:.4f} (bounds {a.mean}, {a.max})")
    for m, x, name in per_file[:5]:
        print(f"  {name}: mean {m:.5f}, max {x:.4f}")
    ok = mean <= a.mean and worst <= a.max
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
