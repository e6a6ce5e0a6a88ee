#!/usr/bin/env python3
"""Write a reproducible folder of ImageNet-like JPEG files for tensorport's preprocessing
benchmarks (the farm on real images, and the PyTorch pipelines it is compared with).

Natural-image content comes from the photographs scikit-image ships (no download): each output
is a random window of one photograph, maybe mirrored, with brightness/contrast jitter and a
little Gaussian noise, scaled to one of the common ImageNet frame sizes and saved as a baseline
4:2:0 JPEG at quality 94. That gives files like ImageNet validation images: ~90 KiB and ~190k
pixels on average, with similar decode cost.

    python3 bench/peers/make_jpegs.py OUT_DIR [--count 2000] [--seed 0] [--varied | --mixed]

--varied writes a folder like a real photo collection instead: sizes from 160-pixel thumbnails
to 12- and 16-megapixel camera frames (a third of the files over 2 megapixels), aspect ratios
from 1:3 to 4:1, a fifth progressive, a tenth grayscale, chroma 4:4:4, 4:2:2 or 4:2:0, quality
60-98. Every file's settings are listed in OUT_DIR/varied.tsv.

--mixed writes baseline colour photos of mixed size and chroma, the most common real folder
(camera and phone photos, web images): the sizes and ratios of --varied, chroma 4:4:4, 4:2:2 and
4:2:0 in equal parts, quality 60-98, none progressive or grayscale (also listed in varied.tsv).

Needs numpy, pillow and scikit-image (pip install numpy pillow scikit-image). The same seed gives
the same files; different seeds may share a folder.
"""
import argparse
import os

import numpy as np
from PIL import Image, ImageEnhance
from skimage import data as photos

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "retina", "hubble_deep_field",
          "immunohistochemistry")
FRAMES = ((500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (640, 480))


def window(rng, img):
    """A random window covering 30-100% of the photograph, aspect ratio within 3:4..4:3."""
    w, h = img.size
    area = rng.uniform(0.3, 1.0) * w * h
    ratio = np.exp(rng.uniform(np.log(0.75), np.log(4 / 3)))
    cw = int(np.clip(np.sqrt(area * ratio), 64, w))
    ch = int(np.clip(np.sqrt(area / ratio), 64, h))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    return img.crop((x, y, x + cw, y + ch))


def one(rng, sources):
    img = window(rng, sources[rng.integers(len(sources))])
    if rng.integers(2):
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    img = img.resize(FRAMES[rng.integers(len(FRAMES))], Image.Resampling.BICUBIC)
    img = ImageEnhance.Brightness(img).enhance(rng.uniform(0.7, 1.3))
    img = ImageEnhance.Contrast(img).enhance(rng.uniform(0.7, 1.3))
    px = np.asarray(img, dtype=np.float32)
    px += rng.normal(0.0, 8.0, px.shape).astype(np.float32)
    return Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))


# Varied mode: (width, height) pools by size class, and aspect ratios (width / height).
THUMBS = ((160, 120), (120, 160), (200, 200), (256, 171))
CAMERA = ((4000, 3000), (3000, 4000), (4608, 3456), (4032, 3024), (3024, 4032), (5472, 3078))
RATIOS = (1 / 3, 9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9, 2.0, 3.0, 4.0)


def varied_one(rng, sources, baseline=False):
    """A photo-like image of a random size class, and how to save it (`baseline`: colour,
    sequential, the three chroma subsamplings in turn)."""
    img = window(rng, sources[rng.integers(len(sources))])
    if rng.integers(2):
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    kind = rng.uniform()
    if kind < 0.15:
        size = THUMBS[rng.integers(len(THUMBS))]
    elif kind < 0.35:
        size = CAMERA[rng.integers(len(CAMERA))]
    else:
        # 0.1 to 4 megapixels at an aspect ratio from 1:3 to 4:1.
        mp = np.exp(rng.uniform(np.log(0.1e6), np.log(4e6)))
        r = RATIOS[rng.integers(len(RATIOS))]
        size = (max(64, int(np.sqrt(mp * r))), max(64, int(np.sqrt(mp / r))))
    img = img.resize(size, Image.Resampling.BICUBIC)
    img = ImageEnhance.Brightness(img).enhance(rng.uniform(0.7, 1.3))
    px = np.asarray(img, dtype=np.float32)
    px += rng.normal(0.0, 6.0, px.shape).astype(np.float32)
    img = Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))
    gray = not baseline and rng.uniform() < 0.1
    if gray:
        img = img.convert("L")
    save = {
        "quality": int(rng.integers(60, 99)),
        "subsampling": int(rng.integers(3)),  # 0: 4:4:4, 1: 4:2:2, 2: 4:2:0
        "progressive": not baseline and bool(rng.uniform() < 0.2),
    }
    return img, save, gray


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write into (created if missing)")
    ap.add_argument("--count", type=int, default=2000, help="files to write [2000]")
    ap.add_argument("--seed", type=int, default=0, help="random seed [0]")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--varied", action="store_true",
                      help="a varied photo collection (sizes, ratios, progressive, grayscale, chroma, quality)")
    kind.add_argument("--mixed", action="store_true",
                      help="baseline colour photos of mixed size and chroma (4:4:4, 4:2:2, 4:2:0)")
    a = ap.parse_args()
    if a.count < 1:
        ap.error("--count must be at least 1")
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    sources = [Image.fromarray(getattr(photos, p)()[..., :3]) for p in PHOTOS]
    size = pixels = 0
    if a.varied or a.mixed:
        listing = open(os.path.join(a.out, "varied.tsv"), "a")
        kinds = {"progressive": 0, "gray": 0, "over_2mp": 0}
        for i in range(a.count):
            img, save, gray = varied_one(rng, sources, baseline=a.mixed)
            if a.mixed:
                save["subsampling"] = (a.seed + i) % 3
            path = os.path.join(a.out, f"{'m' if a.mixed else 'v'}{a.seed:03d}-{i:06d}.jpg")
            img.save(path, "JPEG", **save)
            w, h = img.size
            listing.write(f"{os.path.basename(path)}\t{w}\t{h}\t{save['quality']}\t"
                          f"{save['subsampling']}\t{int(save['progressive'])}\t{int(gray)}\n")
            size += os.path.getsize(path)
            pixels += w * h
            kinds["progressive"] += save["progressive"]
            kinds["gray"] += gray
            kinds["over_2mp"] += w * h > 2e6
        listing.close()
        print(f"{a.count} {'mixed' if a.mixed else 'varied'} JPEG files in {a.out}: mean {size / a.count / 1024:.0f} KiB, "
              f"{pixels / a.count / 1e6:.2f} megapixels; {kinds['progressive']} progressive, "
              f"{kinds['gray']} grayscale, {kinds['over_2mp']} over 2 megapixels")
        return
    for i in range(a.count):
        img = one(rng, sources)
        path = os.path.join(a.out, f"s{a.seed:03d}-{i:06d}.jpg")
        img.save(path, "JPEG", quality=94, subsampling=2)
        size += os.path.getsize(path)
        pixels += img.size[0] * img.size[1]
    print(f"{a.count} JPEG files in {a.out}: mean {size / a.count / 1024:.0f} KiB, "
          f"{pixels / a.count / 1000:.0f}k pixels")


if __name__ == "__main__":
    main()
