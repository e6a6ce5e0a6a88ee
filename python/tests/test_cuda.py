"""Torch CUDA tensors handed to `tensorport serve --device cuda` in place. Needs torch with a
GPU and the CUDA build of the binary (TENSORPORT_BIN); skipped, saying so, elsewhere. On the
GPU machine without pytest: `python3 python/tests/test_cuda.py`."""

import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

try:
    import pytest
except ImportError:  # run as a script on a machine without pytest
    pytest = None

import tensorport


def _why_not():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not os.environ.get("TENSORPORT_BIN"):
        return "TENSORPORT_BIN (the CUDA build of tensorport) is not set"
    return None


if pytest is not None:
    pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"GPU test: {_why_not()}")


class CudaServer:
    """`tensorport serve --device cuda --image-size 32`, up while in use."""

    def __init__(self, d):
        self.sock = os.path.join(d, "tp.sock")
        self.p = subprocess.Popen(
            [os.environ["TENSORPORT_BIN"], "--log", "warn", "serve", "--socket", self.sock,
             "--device", "cuda", "--image-size", "32"], stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        assert line.startswith("ready"), line

    def close(self):
        self.p.send_signal(signal.SIGTERM)
        self.p.wait(timeout=60)


def scores(p, submit):
    rid = submit()
    got, data = p.recv(timeout=60)
    assert got == rid
    return np.frombuffer(data, dtype=np.float32)


def check_against_host_path(d):
    import torch

    srv = CudaServer(d)
    try:
        g = torch.Generator(device="cuda").manual_seed(7)
        with tensorport.Producer(srv.sock, name="torch") as p:
            # Whole tensors, each its own allocation.
            worst = 0.0
            for _ in range(8):
                x = torch.randn(3, 32, 32, device="cuda", generator=g)
                dev = scores(p, lambda: p.submit_tensor(x))
                host = scores(p, lambda: p.submit_array(x.cpu().numpy()))
                worst = max(worst, float(np.max(np.abs(dev - host) / (np.abs(host) + 1e-6))))
            # Rows of one batch tensor: tensors inside a caching-allocator segment, not at its
            # base, one hand-off of the allocation at a time.
            big = torch.randn(4, 3, 32, 32, device="cuda", generator=g)
            for k in (2, 1, 3):
                dev = scores(p, lambda: p.submit_tensor(big[k]))
                host = scores(p, lambda: p.submit_array(big[k].cpu().numpy()))
                worst = max(worst, float(np.max(np.abs(dev - host) / (np.abs(host) + 1e-6))))
            # One tensor rewritten in place between hand-offs, on torch's stream: each write
            # must come after the server's reads of the previous hand-off.
            x = torch.zeros(3, 32, 32, device="cuda")
            for k in range(20):
                x.add_(0.1 * k)
                want = x.cpu().numpy().copy()
                dev = scores(p, lambda: p.submit_tensor(x))
                host = scores(p, lambda: p.submit_array(want))
                worst = max(worst, float(np.max(np.abs(dev - host) / (np.abs(host) + 1e-6))))
            # An allocation given back to the driver and another made at the same address: the
            # hand-off must show the new memory, not the registration of the old one.
            reused = 0
            for k in range(4):
                y = torch.full((3, 32, 32), 0.25 * (k + 1), device="cuda")
                base = y.data_ptr()
                dev = scores(p, lambda: p.submit_tensor(y))
                host = scores(p, lambda: p.submit_array(y.cpu().numpy()))
                worst = max(worst, float(np.max(np.abs(dev - host) / (np.abs(host) + 1e-6))))
                del y
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                z = torch.empty(3, 32, 32, device="cuda")
                reused += z.data_ptr() == base
                del z
        print(f"  35 torch CUDA tensors through serve --device cuda ({reused} of 4 freed "
              f"allocations' addresses reused); worst relative difference from the host path "
              f"{worst:.2e}")
        assert worst < 1e-4, worst
    finally:
        srv.close()


def test_torch_cuda_tensors_answer_as_the_host_path(tmp_path):
    check_against_host_path(str(tmp_path))


def check_loader_on_the_gpu(d):
    """`Loader(device="cuda")`: CPU producers' slots copied into CUDA batches, and GPU producers
    (nvJPEG) handing over device memory; every file once, and the two agree."""
    import torch

    images = os.path.join(d, "images")
    subprocess.run([os.environ["TENSORPORT_BIN"], "images", "--out", images, "--count", "40"],
                   check=True, stdout=subprocess.DEVNULL)
    files = sorted(os.path.join(images, f) for f in os.listdir(images))

    def load(slow=False, **kw):
        got = {}
        for x, idx in tensorport.Loader(files, batch_size=8, image_size=64, device="cuda",
                                        binary=os.environ["TENSORPORT_BIN"], **kw):
            assert x.is_cuda and x.dtype == torch.float32 and x.shape[1:] == (3, 64, 64)
            if slow:
                # The caller's stream busy before it reads the batch: the batches gathered
                # ahead meanwhile must not take its memory.
                torch.cuda._sleep(20_000_000)
            for a, i in zip(x, idx.tolist()):
                assert i not in got
                got[i] = a.clone()
        assert sorted(got) == list(range(len(files)))
        return got

    cpu = load(producers=2)
    # Batches gathered ahead on the loader's stream equal those gathered when asked for, also
    # when the caller's stream lags behind.
    asked = load(producers=2, prefetch=0)
    lagging = load(producers=2, prefetch=4, slow=True)
    assert all(torch.equal(cpu[i], asked[i]) and torch.equal(cpu[i], lagging[i]) for i in cpu)
    gpu = load(producers=0, gpu_producers=1)
    mixed = load(producers=1, gpu_producers=1)
    # Persistent GPU producers: two epochs from one farm, every file once in each.
    kept = tensorport.Loader(files, batch_size=8, image_size=64, device="cuda", producers=0,
                             gpu_producers=1, binary=os.environ["TENSORPORT_BIN"], shuffle=True,
                             seed=1, persistent=True)
    farms = []
    for _ in range(2):
        seen = [i for x, idx in kept for i in idx.tolist()]
        assert sorted(seen) == list(range(len(files)))
        farms.append(list(kept.producer_pids))
    assert farms[0] == farms[1] and farms[0]
    kept.close()
    diff = torch.stack([(cpu[i] - gpu[i]).abs().mean() for i in cpu])
    worst = max(float((cpu[i] - mixed[i]).abs().mean()) for i in cpu)
    print(f"  Loader(device='cuda'): 40 files once each with CPU, GPU and mixed producers, and "
          f"prefetched (lagging caller) = gathered when asked; mean "
          f"|GPU - CPU| {float(diff.mean()):.4f} (worst file {float(diff.max()):.4f}); mixed "
          f"vs CPU worst file {worst:.4f}; two epochs from one persistent farm")
    assert float(diff.mean()) < 0.01 and worst < 0.05


def test_loader_on_the_gpu(tmp_path):
    check_loader_on_the_gpu(str(tmp_path))


def check_device_views(d):
    """A Python consumer viewing GPU producers' tensors in place (`Request.tensor()`), against
    the same files prepared by CPU producers and viewed in their pools."""
    import torch

    images = os.path.join(d, "images")
    subprocess.run([os.environ["TENSORPORT_BIN"], "images", "--out", images, "--count", "24"],
                   check=True, stdout=subprocess.DEVNULL)
    jpegs = sorted(f for f in os.listdir(images) if f.endswith(".jpg"))

    def collect(extra):
        sock = os.path.join(d, f"v{len(extra)}.sock")
        server = tensorport.Server(sock, slots=8, slot_size=3 * 64 * 64 * 4, cuda_device=0)
        p = subprocess.Popen(
            [os.environ["TENSORPORT_BIN"], "--log", "warn", "produce", "--socket", sock,
             "--input", images, "--image-size", "64"] + extra, stdout=subprocess.DEVNULL)
        got, devices, kept = {}, 0, []
        while len(got) < 24:
            for r in server.recv_batch(8, timeout=30):
                t = r.tensor()
                devices += r.device
                got[r.request_id] = t.float().cpu().clone() if t.is_cuda else t.clone()
                r.respond(b"\0" * 40)  # 10 float scores, as the producer expects
                kept.append((r.request_id, t))
        assert p.wait(timeout=60) == 0
        # Views kept past their answers and the producer's end: what they point into is
        # still mapped, so reading them is no illegal address (which would raise here and
        # break this process's CUDA context); their bytes may have been reused by the
        # producer after the answer, so their values are not compared.
        for rid, t in kept[-4:]:
            t.float().sum().item()
        torch.cuda.synchronize()
        assert torch.ones(1, device="cuda").item() == 1.0
        server.drain()
        return got, devices

    cpu, _ = collect([])
    gpu, devices = collect(["--nvjpeg"])
    # Every one in device memory: the JPEGs decoded by nvJPEG, the PNGs prepared on the CPU
    # and copied up by the GPU producer.
    assert devices == 24, devices
    worst = max(float((cpu[i] - gpu[i]).abs().mean()) for i in cpu)
    print(f"  Request.tensor(): 24 GPU producer tensors viewed in place on the GPU "
          f"({len(jpegs)} decoded by nvJPEG); worst file's mean |GPU - CPU| {worst:.4f}")
    assert worst < 0.01


def test_device_views(tmp_path):
    check_device_views(str(tmp_path))


def check_device_rows_refused(d):
    """Memory that is not one allocation of the server's GPU is refused before a batch is
    taken: rows past a torch tensor's allocation, and host memory."""
    import torch

    server = tensorport.Server(os.path.join(d, "r.sock"), cuda_device=0)
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    host = np.zeros(1 << 20, dtype=np.uint8)
    refused = []
    for address, why in [(x.data_ptr() + x.numel(), "past its allocation"),
                         (host.ctypes.data, "host memory")]:
        try:
            # 1 GiB of rows: past any segment torch's allocator holds for a 1 MiB tensor.
            server._native._recv_into_device(address, 4, 1 << 28, stream, timeout=0)
        except ValueError as e:
            refused.append(f"{why}: {e}")
        else:
            raise AssertionError(f"{why} was taken")
    assert torch.ones(1, device="cuda").item() == 1.0
    print("  " + "; ".join(refused))


def test_device_rows_refused(tmp_path):
    check_device_rows_refused(str(tmp_path))


if __name__ == "__main__":
    why = _why_not()
    if why:
        print(f"skipped: GPU test: {why}")
        sys.exit(0)
    with tempfile.TemporaryDirectory() as d:
        check_against_host_path(d)
    with tempfile.TemporaryDirectory() as d:
        check_loader_on_the_gpu(d)
    with tempfile.TemporaryDirectory() as d:
        check_device_views(d)
    with tempfile.TemporaryDirectory() as d:
        check_device_rows_refused(d)
    print("4 passed")
