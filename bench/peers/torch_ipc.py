#!/usr/bin/env python3
"""torch.multiprocessing hand-off between processes: the peer of `tensorport bench` (CPU
tensors) and `tensorport-dev gpu bench-ipc` (CUDA tensors).

  cpu    producer processes put CPU tensors on a torch.multiprocessing Queue (shared memory,
         file-descriptor strategy); the consumer reads one element of each
  cuda   one producer fills CUDA tensors from a pool of 4 and puts them on a Queue (CUDA IPC); the
         consumer copies each into its own tensor, synchronises, then hands the pool slot back

    python3 bench/peers/torch_ipc.py cpu|cuda|all [--json OUT]
"""
import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

POOL = 4


def cpu_producer(q, finished, shape, count):
    for i in range(count):
        q.put(torch.full(shape, float(i)))
    q.put(None)
    # Shared CPU tensors travel as fds the receiver must still fetch: stay alive until told.
    finished.wait()


def cpu_run(shape, count, producers):
    q, finished = mp.Queue(maxsize=64), mp.Event()
    procs = [mp.Process(target=cpu_producer, args=(q, finished, shape, count // producers))
             for _ in range(producers)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    ended = got = nbytes = 0
    first = last = None
    while ended < producers:
        t = q.get()
        if t is None:
            ended += 1
            continue
        float(t.view(-1)[0])
        got += 1
        nbytes += t.numel() * t.element_size()
        last = time.perf_counter()
        if first is None:
            first = last
    secs = time.perf_counter() - start
    finished.set()
    for p in procs:
        p.join()
    # Also the rate after start-up: from the first tensor received to the last.
    steady = (got - 1) / (last - first) if got > 1 and last > first else 0.0
    return got / secs, nbytes / secs / 1e9, steady


def cuda_producer(q, back, shape, count):
    pool = [torch.empty(shape, device="cuda") for _ in range(POOL)]
    for i in range(count):
        if i >= POOL:
            back.get()  # the consumer is done with the slot we are about to reuse
        t = pool[i % POOL]
        t.fill_(float(i))
        torch.cuda.synchronize()
        q.put(t)
    q.put(None)
    back.get()
    time.sleep(0.5)  # let the last handles be closed before the allocations go


def cuda_run(shape, count):
    q, back = mp.Queue(maxsize=POOL), mp.Queue()
    p = mp.Process(target=cuda_producer, args=(q, back, shape, count))
    mine = torch.empty(shape, device="cuda")
    start = time.perf_counter()
    p.start()
    waits, got = [], 0
    while True:
        t0 = time.perf_counter()
        t = q.get()
        if t is None:
            break
        mine.copy_(t)
        torch.cuda.synchronize()
        waits.append(time.perf_counter() - t0)
        del t
        back.put(1)
        got += 1
    secs = time.perf_counter() - start
    back.put(1)
    p.join()
    return got / secs, statistics.median(waits) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("cpu", "cuda", "all"))
    ap.add_argument("--json")
    ap.add_argument("--min-bytes", type=int, default=0,
                    help="cpu: only the tensors of at least this many bytes")
    a = ap.parse_args()
    mp.set_start_method("spawn")
    out = {"torch": torch.__version__}
    if a.what in ("cpu", "all"):
        for shape, count in (((1024,), 20000), ((256, 1024), 5000), ((32, 3, 224, 224), 400)):
            if 4 * torch.Size(shape).numel() < a.min_bytes:
                continue
            for producers in (1, 4):
                r, gb, steady = cpu_run(shape, count, producers)
                key = f"cpu shape={list(shape)} producers={producers}"
                out[key] = {"tensors_per_s": r, "GB_per_s": gb, "after_start_up_per_s": steady}
                print(f"torch.multiprocessing {key}: {r:.0f} tensors/s, {gb:.2f} GB/s; "
                      f"{steady:.0f} tensors/s after start-up", flush=True)
    if a.what in ("cuda", "all"):
        print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
        for shape, count in (((1024,), 5000), ((32, 3, 224, 224), 1000)):
            r, us = cuda_run(shape, count)
            key = f"cuda shape={list(shape)}"
            out[key] = {"tensors_per_s": r, "median_get_and_copy_us": us}
            print(f"torch.multiprocessing {key}: {r:.0f} tensors/s, median get+copy {us:.1f} us",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
