#!/usr/bin/env python3
"""Python producers handing tensors to a consumer through tensorport (its loop in Python, then
in the extension: `consumer=rust`), measured as
`bench/peers/torch_ipc.py cpu` measures torch.multiprocessing: each producer process fills a
float32 tensor with its index (here in place, in its slot of shared memory) and hands it over;
the consumer reads one element of each and answers. Run both in one call to compare.

With `--server BINARY` the consumer is instead a separate Rust server process,
`BINARY serve --sink` (answers every tensor at once), and the rates are the producers' own: from
the first tensor handed over to the last result, with every producer connected and started
together, on five times the peer's tensor counts. `--fill torch` fills the slot with torch's
`fill_` on a view of it (torch's own fill, as the peer's `torch.full`; each producer may use its
share of the cores, less two, for it) instead of numpy's.

    PYTHONPATH=<the package> python3 bench/python_ipc.py [--json OUT]
    PYTHONPATH=<the package> python3 bench/python_ipc.py --server target/release/tensorport [--fill torch]
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


def filler(fill, producers):
    """The function that fills a slot's numpy view with a value. torch's fill may use several
    threads: the cores are shared out among the producers, so they do not oversubscribe them."""
    if fill == "torch":
        import torch
        # Two cores left for the server and the parent.
        torch.set_num_threads(max(1, ((os.cpu_count() or 1) - 2) // producers))
        return lambda a, v: torch.from_numpy(a).fill_(v)
    return lambda a, v: a.fill(v)


def timed_producer(sock, shape, count, slots, send, fill, producers, start, out):
    """A producer that connects, waits at `start` for the others, and reports (count, first
    hand-off, last result) on `out`."""
    do_fill = filler(fill, producers)
    first = None
    with tensorport.Producer(sock, name=f"bench-{os.getpid()}", slots=slots) as p:
        start.wait()
        a = np.empty(shape, np.float32) if send else None
        for i in range(count):
            if send:
                do_fill(a, float(i))
                p.send(a, timeout=60)
                if p.in_flight >= slots:
                    p.recv_many(timeout=60)
            else:
                with p.loan(timeout=60) as slot:
                    do_fill(slot.array(np.float32, shape), float(i))
                    slot.submit()
                while p.in_flight >= slots:
                    p.recv(timeout=60)
            if first is None:
                first = time.time()
        while p.in_flight:
            if send:
                p.recv_many(timeout=60)
            else:
                p.recv(timeout=60)
        out.put((count, first, time.time()))


def run_rust_server(binary, shape, count, producers, slots=8, send=False, fill="numpy"):
    """Producers against `BINARY serve --sink` in its own process."""
    import subprocess
    nbytes = int(np.prod(shape)) * 4
    with tempfile.TemporaryDirectory(prefix="tp-pybench-") as d:
        sock = os.path.join(d, "tp.sock")
        server = subprocess.Popen(
            [binary, "serve", "--sink", "--socket", sock, "--slots", str(slots),
             "--slot-size", str(nbytes), "--memory-budget", "16G", "--max-session-memory", "4G"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            line = server.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError(f"{binary} serve --sink did not start: {line!r}")
            out, go = mp.Queue(), mp.Barrier(producers + 1)
            procs = [mp.Process(target=timed_producer,
                                args=(sock, shape, count // producers, slots, send, fill,
                                      producers, go, out))
                     for _ in range(producers)]
            start = time.time()
            for p in procs:
                p.start()
            # Every producer connected: they start together, so the rate after start-up has
            # them all at work (spawning and importing take longer than tensorport's runs).
            go.wait(timeout=300)
            runs = [out.get(timeout=600) for _ in procs]
            end = time.time()
            for p in procs:
                p.join()
        finally:
            server.terminate()
            server.wait(timeout=30)
        total = sum(r[0] for r in runs)
        first = min(r[1] for r in runs)
        last = max(r[2] for r in runs)
        return total / (end - start), total * nbytes / (end - start) / 1e9, total / (last - first)


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
    ap.add_argument("--server", metavar="BINARY",
                    help="hand over to `BINARY serve --sink` (a Rust server process) instead")
    ap.add_argument("--fill", choices=("numpy", "torch"), default="numpy",
                    help="with --server: how producers fill their slots [numpy]")
    ap.add_argument("--min-bytes", type=int, default=0,
                    help="with --server: only the tensors of at least this many bytes")
    a = ap.parse_args()
    mp.set_start_method("spawn")
    out = {}
    if a.server:
        # Five times the peer's counts: at tensorport's rates the peer's would last milliseconds.
        cases = [(((1024,), 100000), (1, 4), (False, True)),
                 (((256, 1024), 25000), (1, 4), (False, True)),
                 (((32, 3, 224, 224), 2000), (1, 4), (False,))]
        for (shape, count), producer_counts, modes in cases:
            if int(np.prod(shape)) * 4 < a.min_bytes:
                continue
            for producers in producer_counts:
                for send in modes:
                    r, gb, steady = run_rust_server(a.server, shape, count, producers,
                                                    send=send, fill=a.fill)
                    key = (f"cpu shape={list(shape)} producers={producers} server=rust "
                           f"producer={'send' if send else 'loan'} fill={a.fill}")
                    out[key] = {"tensors_per_s": r, "GB_per_s": gb, "after_start_up_per_s": steady,
                                "after_start_up_GB_per_s": steady * int(np.prod(shape)) * 4 / 1e9}
                    print(f"tensorport (Python producers) {key}: {r:.0f} tensors/s, {gb:.2f} GB/s; "
                          f"{steady:.0f} tensors/s ({steady * int(np.prod(shape)) * 4 / 1e9:.2f} GB/s) "
                          f"after start-up", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return
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
