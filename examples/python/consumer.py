"""A Python consumer fed by Rust producers: a tensorport Server in this process.

    python examples/python/consumer.py /tmp/py.sock &
    tensorport produce --socket /tmp/py.sock --synthetic 100 --image-size 64

Each request is a read-only numpy view into the producer's pool (no copy); the answer goes back
to the producer that asked (here: the tensor's mean, as one float32 "score").
"""

import sys

import numpy as np
import tensorport

server = tensorport.Server(sys.argv[1] if len(sys.argv) > 1 else "/tmp/py.sock",
                           slot_size=3 * 64 * 64 * 4)
print(f"listening on {server.socket}", flush=True)
served = 0
while True:
    batch = server.recv_batch(max=32, timeout=1.0)
    if not batch and served and server.sessions == 0:
        break
    if batch:
        x = np.stack([r.array() for r in batch])  # one copy, into the batch
        for r, mean in zip(batch, x.reshape(len(batch), -1).mean(axis=1)):
            r.respond(np.array([mean], dtype=np.float32))
        served += len(batch)
print(f"served {served} tensors")
