#!/usr/bin/env python3
"""ResNet-50 as an ONNX file made with the `onnx` package alone (no PyTorch): the graph
torchvision's ResNet-50 exports to once batch normalisation is folded into the convolutions
(7x7 stem, max pool, bottleneck stages of 3, 4, 6 and 3 blocks with the stride on the 3x3
convolution, global average pool, a 2048 -> 1000 Gemm), with random weights from a fixed seed
(speed, not accuracy; scaled so that activations neither vanish nor overflow in f16). Input
"images" [N, 3, 224, 224] with a dynamic batch axis N, output "scores" [N, 1000], as
bench/peers/resnet50_onnx.py writes from torchvision where PyTorch is installed.

    python3 bench/peers/resnet50_onnx_graph.py OUT.onnx [--f16] [--seed 0]

Needs numpy and onnx.
"""
import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(dtype, seed):
    rng = np.random.default_rng(seed)
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    nodes, inits = [], []
    count = [0]

    def name(kind):
        count[0] += 1
        return f"{kind}{count[0]}"

    def conv(x, cin, cout, k, stride=1, gain=1.0, relu=True):
        w, b, y = name("w"), name("b"), name("conv")
        std = gain * np.sqrt(2.0 / (cin * k * k))
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((cout, cin, k, k)) * std).astype(dtype), w))
        inits.append(numpy_helper.from_array(np.zeros(cout, dtype), b))
        nodes.append(helper.make_node("Conv", [x, w, b], [y], kernel_shape=[k, k],
                                      strides=[stride, stride], pads=[k // 2] * 4))
        if not relu:
            return y
        r = name("relu")
        nodes.append(helper.make_node("Relu", [y], [r]))
        return r

    x = conv("images", 3, 64, 7, stride=2)
    pooled = name("pool")
    nodes.append(helper.make_node("MaxPool", [x], [pooled], kernel_shape=[3, 3],
                                  strides=[2, 2], pads=[1, 1, 1, 1]))
    x, cin = pooled, 64
    for blocks, width, stride in ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)):
        cout = width * 4
        for i in range(blocks):
            s = stride if i == 0 else 1
            y = conv(x, cin, width, 1)
            y = conv(y, width, width, 3, stride=s)
            # The branch's last convolution small, as a block whose batch norm starts near
            # zero: the sum over 16 blocks stays in range.
            y = conv(y, width, cout, 1, gain=0.2, relu=False)
            short = conv(x, cin, cout, 1, stride=s, relu=False) if i == 0 else x
            added, out = name("add"), name("relu")
            nodes.append(helper.make_node("Add", [y, short], [added]))
            nodes.append(helper.make_node("Relu", [added], [out]))
            x, cin = out, cout
    gap, flat = name("gap"), name("flat")
    nodes.append(helper.make_node("GlobalAveragePool", [x], [gap]))
    nodes.append(helper.make_node("Flatten", [gap], [flat], axis=1))
    inits.append(numpy_helper.from_array(
        (rng.standard_normal((1000, 2048)) * np.sqrt(1.0 / 2048)).astype(dtype), "fc_w"))
    inits.append(numpy_helper.from_array(np.zeros(1000, dtype), "fc_b"))
    nodes.append(helper.make_node("Gemm", [flat, "fc_w", "fc_b"], ["scores"], transB=1))
    graph = helper.make_graph(
        nodes, "resnet50", [helper.make_tensor_value_info("images", elem, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("scores", elem, ["N", 1000])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="tensorport bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--f16", action="store_true", help="weights, input and scores in f16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model = build(np.float16 if a.f16 else np.float32, a.seed)
    onnx.save(model, a.out)
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    print(f"{a.out}: ResNet-50, {params / 1e6:.1f} M parameters, "
          f"{len(model.graph.node)} nodes, {'f16' if a.f16 else 'f32'}")


if __name__ == "__main__":
    main()
