"""A Python producer feeding a Rust server: images as float32 tensors, written in place.

    tensorport serve --image-size 224 &          # the Rust server (the bundled classifier)
    python examples/python/producer.py            # 16 random images, their classes printed
"""

import sys

import numpy as np
import tensorport

socket = sys.argv[1] if len(sys.argv) > 1 else None  # None: where `tensorport serve` listens

rng = np.random.default_rng(0)
with tensorport.Producer(socket, name="python-example") as p:
    ids = []
    for i in range(16):
        with p.loan() as slot:
            x = slot.array(np.float32, (3, 224, 224))  # the pool's memory: no copy
            x[...] = rng.standard_normal((3, 224, 224), dtype=np.float32)
            ids.append(slot.submit())
        # Keep a few in flight; collect the rest at the end.
        while p.in_flight > 4:
            rid, scores = p.recv_array(np.float32)
            print(f"request {rid}: class {int(scores.argmax())}")
    while p.in_flight:
        rid, scores = p.recv_array(np.float32)
        print(f"request {rid}: class {int(scores.argmax())}")
