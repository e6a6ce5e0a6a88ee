"""Writes the small ONNX models the ONNX tests serve, with the `onnx` package's helpers and
weights from a fixed seed: image classifiers the server takes, and graphs it must refuse.

    python make_models.py OUT_DIR [IMAGE_SIZE]

Taken (input [N, 3, S, S], first output [N, K]):
  classifier.onnx      conv, relu, max pool, conv, relu, global average pool, flatten, gemm;
                       f32, 10 scores
  classifier_f16.onnx  the same in f16 (input, weights and scores)
  two_outputs.onnx     scores [N, 10] first, then the pooled features [N, 16]
  any_size.onnx        the classifier with its image sides left dynamic [N, 3, ?, ?]
  external.onnx        the classifier with its weights in external.bin beside it
  nonfinite.onnx       the classifier whose scores are multiplied by [NaN, inf, -inf, 1, ...]:
                       every image's scores hold NaN and infinities
Refused:
  fixed_batch.onnx     [8, 3, S, S]: no dynamic batch axis
  two_inputs.onnx      an image and a second input
  int_input.onnx       an int64 image
  rank3.onnx           [N, 3, S*S]
  bad_output.onnx      first output [N, 10, 1]
  huge_side.onnx       the classifier on [N, 3, 16384, 16384]: producers' slots of 3 GiB each
  escape_absolute.onnx external.onnx with its data named by an absolute path to ../outside.bin
  escape_parent.onnx   the same named "../outside.bin"
  escape_link.onnx     the same named "outside_link.bin", a symbolic link to ../outside.bin
"""

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
rng = np.random.default_rng(20261205)


def weights(dtype):
    """The classifier's weights, the same values for every model (cast to `dtype`)."""
    w = {
        "w1": rng.standard_normal((8, 3, 3, 3)) * 0.3,
        "b1": rng.standard_normal(8) * 0.1,
        "w2": rng.standard_normal((16, 8, 3, 3)) * 0.2,
        "b2": rng.standard_normal(16) * 0.1,
        "wf": rng.standard_normal((10, 16)) * 0.3,
        "bf": rng.standard_normal(10) * 0.1,
    }
    return [numpy_helper.from_array(v.astype(dtype), name=k) for k, v in w.items()]


def body(x):
    """The classifier's nodes from input `x`: ends in "scores" [N, 10] and "features" [N, 16]."""
    return [
        helper.make_node("Conv", [x, "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["features"], axis=1),
        helper.make_node("Gemm", ["features", "wf", "bf"], ["scores"], transB=1),
    ]


def model(nodes, inputs, outputs, inits, name):
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                          producer_name="tensorport tests")
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def main():
    out, size = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32
    os.makedirs(out, exist_ok=True)
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    image = helper.make_tensor_value_info("images", f32, ["N", 3, size, size])
    scores = helper.make_tensor_value_info("scores", f32, ["N", 10])
    features = helper.make_tensor_value_info("features", f32, ["N", 16])
    w32 = weights(np.float32)
    models = {
        "classifier": model(body("images"), [image], [scores], w32, "classifier"),
        "classifier_f16": model(
            body("images"),
            [helper.make_tensor_value_info("images", f16, ["N", 3, size, size])],
            [helper.make_tensor_value_info("scores", f16, ["N", 10])],
            [numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name)
             for t in w32],
            "classifier_f16"),
        "two_outputs": model(body("images"), [image], [scores, features], w32, "two_outputs"),
        "any_size": model(
            body("images"),
            [helper.make_tensor_value_info("images", f32, ["N", 3, "H", "W"])],
            [scores], w32, "any_size"),
        "fixed_batch": model(
            body("images"),
            [helper.make_tensor_value_info("images", f32, [8, 3, size, size])],
            [helper.make_tensor_value_info("scores", f32, [8, 10])], w32, "fixed_batch"),
        "two_inputs": model(
            body("images") + [helper.make_node("Add", ["scores", "bias"], ["out"])],
            [image, helper.make_tensor_value_info("bias", f32, ["N", 10])],
            [helper.make_tensor_value_info("out", f32, ["N", 10])], w32, "two_inputs"),
        "int_input": model(
            [helper.make_node("Cast", ["pixels"], ["images"], to=f32)] + body("images"),
            [helper.make_tensor_value_info("pixels", TensorProto.INT64, ["N", 3, size, size])],
            [scores], w32, "int_input"),
        "rank3": model(
            [helper.make_node("Reshape", ["flat", "shape"], ["images"])] + body("images"),
            [helper.make_tensor_value_info("flat", f32, ["N", 3, size * size])],
            [scores],
            w32 + [numpy_helper.from_array(np.array([-1, 3, size, size], np.int64), "shape")],
            "rank3"),
        "bad_output": model(
            body("images") + [helper.make_node("Unsqueeze", ["scores", "axes"], ["out"])],
            [image], [helper.make_tensor_value_info("out", f32, ["N", 10, 1])],
            w32 + [numpy_helper.from_array(np.array([2], np.int64), "axes")], "bad_output"),
        "huge_side": model(
            body("images"),
            [helper.make_tensor_value_info("images", f32, ["N", 3, 16384, 16384])],
            [scores], w32, "huge_side"),
    }
    nonfinite = np.ones(10, np.float32)
    nonfinite[:3] = [np.nan, np.inf, -np.inf]
    models["nonfinite"] = model(
        body("images") + [helper.make_node("Mul", ["scores", "odd"], ["out"])],
        [image], [helper.make_tensor_value_info("out", f32, ["N", 10])],
        w32 + [numpy_helper.from_array(nonfinite, "odd")], "nonfinite")
    for name, m in models.items():
        onnx.save(m, os.path.join(out, f"{name}.onnx"))
    # The classifier with its weights in a file beside it, and copies of it whose data file
    # lies outside the model's folder, named three ways.
    external = model(body("images"), [image], [scores], w32, "external")
    onnx.save(external, os.path.join(out, "external.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="external.bin", size_threshold=0)
    outside = os.path.join(os.path.dirname(os.path.abspath(out)), "outside.bin")
    with open(os.path.join(out, "external.bin"), "rb") as src, open(outside, "wb") as dst:
        dst.write(src.read())
    link = os.path.join(out, "outside_link.bin")
    if not os.path.lexists(link):
        os.symlink(outside, link)
    for name, location in [("escape_absolute", outside), ("escape_parent", "../outside.bin"),
                           ("escape_link", "outside_link.bin")]:
        m = onnx.load(os.path.join(out, "external.onnx"), load_external_data=False)
        for t in m.graph.initializer:
            for entry in t.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save(m, os.path.join(out, f"{name}.onnx"))
        models[name] = m
    models["external"] = external
    print(" ".join(sorted(models)))


if __name__ == "__main__":
    main()
