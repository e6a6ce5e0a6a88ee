"""The reference scores: onnxruntime's Python API, on the CPU, running MODEL on the tensors
`tensorport prep --dump` wrote (one [3, S, S] f32 tensor per file, named by the file), each
image alone. Prints one JSON object: file name -> the first output's scores (as f32 values).

    python reference.py MODEL.onnx TENSORS.safetensors
"""

import json
import struct
import sys

import numpy as np
import onnxruntime as ort


def read_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        assert meta["dtype"] == "F32", meta
        out[name] = np.frombuffer(data[a:b], dtype=np.float32).reshape(meta["shape"])
    return out


def main():
    model, tensors = sys.argv[1], sys.argv[2]
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    inp = session.get_inputs()[0]
    dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
    scores = {}
    for name, x in read_safetensors(tensors).items():
        y = session.run(None, {inp.name: x[None].astype(dtype)})[0]
        scores[name] = [float(v) for v in y[0].astype(np.float32)]
    print(json.dumps(scores))


if __name__ == "__main__":
    main()
