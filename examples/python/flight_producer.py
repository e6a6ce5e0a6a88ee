#!/usr/bin/env python3
"""A remote producer written in Python with pyarrow.flight alone, from docs/scale-out.md's format.

It sends COUNT float32 tensors of SHAPE to a `tensorport-bridge gateway` on one DoExchange
stream, in Arrow batches of BATCH tensors (tensor i holds arange(n) + i), and prints one JSON
line per answer: {"id", "scores"} or {"id", "code", "error"}.

    python3 flight_producer.py grpc://127.0.0.1:7450 TOKEN_FILE [--count 100] [--shape 3,32,32]

Needs pyarrow and numpy (`pip install pyarrow numpy`).
"""
import argparse
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight


def tensor_schema(shape):
    """The bridge's schema: a request id, and a column of Arrow's fixed_shape_tensor type."""
    n = int(np.prod(shape))
    meta = {
        b"ARROW:extension:name": b"arrow.fixed_shape_tensor",
        b"ARROW:extension:metadata": json.dumps({"shape": list(shape)}).encode(),
    }
    return pa.schema(
        [
            pa.field("id", pa.uint64(), nullable=False),
            pa.field(
                "tensor",
                pa.list_(pa.field("item", pa.float32(), nullable=False), n),
                nullable=False,
                metadata=meta,
            ),
        ]
    )


def batch_of(schema, ids, shape):
    n = int(np.prod(shape))
    values = np.concatenate([np.arange(n, dtype=np.float32) + i for i in ids])
    tensors = pa.FixedSizeListArray.from_arrays(pa.array(values, pa.float32()), n)
    # Cast to the schema's exact type (non-nullable items).
    tensors = tensors.cast(schema.field("tensor").type)
    return pa.record_batch([pa.array(ids, pa.uint64()), tensors], schema=schema)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gateway", help="grpc://HOST:PORT, or grpc+tls://HOST:PORT")
    ap.add_argument("token_file")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--shape", default="3,32,32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--name", default="pyarrow")
    a = ap.parse_args()
    shape = [int(d) for d in a.shape.split(",")]
    token = open(a.token_file).read().strip()
    client = flight.FlightClient(a.gateway)
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])
    schema = tensor_schema(shape)
    descriptor = flight.FlightDescriptor.for_path(a.name)
    writer, reader = client.do_exchange(descriptor, options=options)
    answered = set()
    with writer:
        writer.begin(schema)
        for start in range(0, a.count, a.batch):
            ids = list(range(start, min(start + a.batch, a.count)))
            writer.write_batch(batch_of(schema, ids, shape))
        writer.done_writing()
        # Answers: id, result (little-endian f32 for the bundled model), code, error.
        for chunk in reader:
            t = chunk.data
            if t is None:
                continue
            for i in range(t.num_rows):
                rid = t.column("id")[i].as_py()
                result = t.column("result")[i].as_py()
                if result is not None:
                    line = {"id": rid, "scores": np.frombuffer(result, "<f4").tolist()}
                else:
                    line = {
                        "id": rid,
                        "code": t.column("code")[i].as_py(),
                        "error": t.column("error")[i].as_py(),
                    }
                answered.add(rid)
                print(json.dumps(line), flush=True)
    if len(answered) != a.count:
        sys.exit(f"{a.count - len(answered)} tensors got no answer")


if __name__ == "__main__":
    main()
