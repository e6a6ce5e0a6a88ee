#!/usr/bin/env python3
"""torchvision's ResNet-50 (random weights from a fixed seed: speed, not accuracy) as ONNX files
the server takes: input "images" [N, 3, 224, 224] with a dynamic batch axis N, output "scores"
[N, 1000]. Writes OUT_DIR/resnet50.onnx (f32) and OUT_DIR/resnet50_f16.onnx (the same network
in f16: input, weights and scores).

    python3 bench/peers/resnet50_onnx.py OUT_DIR

Needs torch and torchvision (and onnx, onnxscript for torch's exporter); on a GPU the f16 file
is exported there.
"""
import os
import sys

import torch
import torchvision


def export(model, x, path):
    kw = dict(input_names=["images"], output_names=["scores"], opset_version=17)
    try:
        torch.onnx.export(model, (x,), path, dynamo=False,
                          dynamic_axes={"images": {0: "N"}, "scores": {0: "N"}}, **kw)
    except Exception as e:  # an exporter without the TorchScript path
        print(f"TorchScript export failed ({e}); using torch.export", file=sys.stderr)
        n = torch.export.Dim("N", min=1, max=4096)
        torch.onnx.export(model, (x,), path, dynamo=True, dynamic_shapes=({0: n},), **kw)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = torchvision.models.resnet50().eval().to(dev)
    x = torch.randn(2, 3, 224, 224, device=dev)
    with torch.no_grad():
        export(model, x, os.path.join(out, "resnet50.onnx"))
        export(model.half(), x.half(), os.path.join(out, "resnet50_f16.onnx"))
    print(" ".join(sorted(os.listdir(out))))


if __name__ == "__main__":
    main()
