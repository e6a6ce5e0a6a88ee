#!/usr/bin/env python3
"""Python producers handing tensors to a consumer through tensorport (its loop in Python, then
in the extension: `consumer=rust`), measured as
`bench/peers/torch_ipc.py cpu` measures torch.multiprocessing: each producer process fills a
float32 tensor with its index (here in place, in its slot of shared memory) and hands it over;
the consumer reads one element of each and answers. Run both in one call to compare.

    PYTHONPATH=<the package> python3 bench/python_ipc.py [--json OUT]
"""
import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np

import tensorport


def producer(sock, shape, count, slots, send=False):
    with tensorport.Producer(sock, name=f"bench-{os.getpid()}", slots=slots) as p:
        if send:
            # One call per tensor: fill a numpy array, `send` copies it into a slot; results
            # are taken in batches.
            a = np.empty(shape, np.float32)
            for i in range(count):
                a.fill(float(i))
                p.send(a, timeout=60)
                if p.in_flight >= slots:
                    p.recv_many(timeout=60)
            while p.in_flight:
                p.recv_many(timeout=60)
            return
        for i in range(count):
            with p.loan(timeout=60) as slot:
                slot.array(np.float32, shape).fill(float(i))
                slot.submit()
            while p.in_flight >= slots:
                p.recv(timeout=60)
        while p.in_flight:
            p.recv(timeout=60)


def run(shape, count, producers, slots=8, rust_consumer=False, send=False):
    nbytes = int(np.prod(shape)) * 4
    with tempfile.TemporaryDirectory(prefix="tp-pybench-") as d:
        sock = os.path.join(d, "tp.sock")
        server = tensorport.Server(sock, slots=slots, slot_size=nbytes)
        procs = [mp.Process(target=producer, args=(sock, shape, count // producers, slots, send))
                 for _ in range(producers)]
        start = time.perf_counter()
        for p in procs:
            p.start()
        got = moved = 0
        first = last = None
        total = (count // producers) * producers
        while got < total:
            if rust_consumer:
                # The consumer's work in the extension: no Python per tensor.
                n, b = server._native._ack_batch(64, 1.0)
                got += n
                moved += b
            else:
                for r in server.recv_batch(64, timeout=1.0, max_wait=0.0):
                    float(r.array().flat[0])
                    moved += r.nbytes
                    r.respond(b"")
                    got += 1
            if got:
                last = time.perf_counter()
                if first is None:
                    first = (last, got)
        secs = time.perf_counter() - start
        for p in procs:
            p.join()
        # Also the rate after start-up: from the first tensors received to the last.
        steady = (got - first[1]) / (last - first[0]) if first and last > first[0] else 0.0
        return got / secs, moved / secs / 1e9, steady


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    a = ap.parse_args()
    mp.set_start_method("spawn")
    out = {}
    for consumer in ("python", "rust"):
        for shape, count in (((1024,), 20000), ((256, 1024), 5000), ((32, 3, 224, 224), 400)):
            for producers in (1, 4):
                r, gb, steady = run(shape, count, producers, rust_consumer=consumer == "rust")
                key = f"cpu shape={list(shape)} producers={producers} consumer={consumer}"
                out[key] = {"tensors_per_s": r, "GB_per_s": gb, "after_start_up_per_s": steady}
                print(f"tensorport (Python producers) {key}: {r:.0f} tensors/s, {gb:.2f} GB/s; "
                      f"{steady:.0f} tensors/s after start-up", flush=True)
    # Small tensors from producers that `send` (copy in one call) instead of loaning.
    for shape, count in (((1024,), 20000), ((256, 1024), 5000)):
        for producers in (1, 4):
            r, gb, steady = run(shape, count, producers, rust_consumer=True, send=True)
            key = f"cpu shape={list(shape)} producers={producers} consumer=rust producer=send"
            out[key] = {"tensors_per_s": r, "GB_per_s": gb, "after_start_up_per_s": steady}
            print(f"tensorport (Python producers) {key}: {r:.0f} tensors/s, {gb:.2f} GB/s; "
                  f"{steady:.0f} tensors/s after start-up", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
