"""`tensorport.Loader`: a DataLoader stand-in over image files, fed by a farm of producer
processes into this process's own server (docs/python.md)."""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import signal
from typing import List, Optional, Tuple

from . import _QUARANTINED, Server, TensorportError, _native, _np, command

_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


# This process's MPS, by GPU: kept for the life of the process (its CUDA context is a client),
# and asked to quit as it exits.
_MPS: dict = {}


def _share_gpu(mode: str, gpu: int) -> None:
    """Has this process, and the farms it starts (they inherit its environment), join CUDA's
    Multi-Process Service on `gpu` before CUDA starts here: a running daemon, or a private one.
    Where MPS cannot be had, logs why once (`mode="on"`: raises `RuntimeError`)."""
    import os
    import sys

    if mode == "off" or gpu in _MPS or os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return
    log = logging.getLogger("tensorport")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        why = ("CUDA had already started in this process, and joins MPS only as it starts: "
               "create the Loader before anything here uses the GPU, or start an MPS daemon "
               "before this process")
        if mode == "on":
            raise RuntimeError(f"mps='on': {why}")
        _MPS[gpu] = None
        log.warning("Loader: the GPU producers and this process take turns on the GPU: %s", why)
        return
    m = _native.Mps(mode, [gpu])
    _MPS[gpu] = m
    for k, v in m.env.items():
        os.environ[k] = v
    (log.warning if m.why_off else log.info)("Loader: %s", m.describe())
    if m.env:
        atexit.register(m.quit_at_exit)


# Threads ending a finished epoch's server (`_end_later`): joined as the interpreter exits,
# before the package's own exit handler.
_ENDING: "set" = set()


def _end_later(ending: list, folder: str):
    """Drops the last reference to a finished epoch's server (in `ending`) and removes its
    folder on a thread of their own, which it returns (`None` where no thread could start:
    done here, then). The server ends without the GIL."""
    import shutil
    import threading

    def end():
        try:
            ending.clear()
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            _ENDING.discard(thread)

    thread = threading.Thread(target=end, name="tensorport-loader-end", daemon=True)
    _ENDING.add(thread)
    try:
        thread.start()
    except RuntimeError:  # no new thread now (the interpreter is exiting, say): here, then
        end()
        return None
    return thread


def _join_ending() -> None:
    for thread in list(_ENDING):
        thread.join(timeout=10)


atexit.register(_join_ending)


def _private_dir() -> str:
    """A fresh folder for a loader's socket, readable by this user alone, named with this
    process's pid; folders left by loaders whose process is gone (killed, say) are removed
    first."""
    import os
    import shutil
    import tempfile

    base = tempfile.gettempdir()
    prefix = "tensorport-loader-"
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if not name.startswith(prefix) or not pid.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # alive (another user's), or gone already
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


class Loader:
    """Batches of preprocessed images from a farm of Rust producer processes, as an iterable:
    a stand-in for `torch.utils.data.DataLoader` over image files.

        for images, indices in tensorport.Loader(files, batch_size=32, producers=8):
            ...   # images: float32 [B, 3, S, S] (ImageNet-normalised); indices: positions in files

        loader = tensorport.Loader.from_folder("train/", batch_size=32, shuffle=True, seed=0)
        for epoch in range(3):
            for images, labels in loader:          # ImageFolder layout: one folder per class
                ...

        for images, indices in tensorport.Loader(files, device="cuda", gpu_producers=1):
            ...   # images: a torch CUDA tensor, decoded and prepared on the GPU (nvJPEG)

    Each producer (`tensorport produce`, started with `command(binary)`) decodes, resizes
    and normalises files straight into its slots of shared memory; this process copies each
    batch out once and hands the slots back. The producers are supervised by `tensorport farm`
    attached to this process's server (the same code the `farm` command runs: files handed out
    as producers have room, dead or hung producers restarted and their files redone). Every batch holds
    `batch_size` images (the last one fewer, or none with `drop_last`), in the order the
    producers finish them; every file comes exactly once per epoch (each `for` over the loader
    is an epoch, with fresh producers — or, with `persistent=True`, the same ones, kept waiting
    between epochs until `close()`, as the DataLoader's `persistent_workers`). With `labels` (a
    sequence, one per file) or `from_folder`, batches are `(images, labels)`; otherwise
    `(images, indices)` — and
    `last_indices` holds the batch's positions in `files` either way.

    A producer that dies (killed, say) is started again and its unfinished files redone; when
    every producer has failed `max_restarts` times in a row the iteration ends with
    `TensorportError`. A file that cannot be prepared raises `TensorportError` naming it, or,
    with `on_error="skip"`, is left out and listed in `skipped`. The producers end with the
    iteration (at its end, at `break`, on `KeyboardInterrupt`, when the iterator is collected)
    and with this process, even if it is killed.

    With `device="cuda"` (or `"cuda:N"`) batches are torch tensors on that GPU: the producers'
    slots are pinned and copied into the batch by DMA, and `gpu_producers` producers
    (`tensorport produce --nvjpeg`) decode and prepare their files on the GPU and hand them
    over in device memory; with both kinds, plain JPEGs go to the GPU producers first (the CPU
    producers take those the GPU producers have no room for) and the rest to the CPU producers
    (docs/operations.md). Given neither `producers` nor `gpu_producers`, a loader on a GPU
    starts the mix `tensorport farm --device cuda` starts (two GPU producers where nvJPEG
    loads, CPU producers for the other cores; logged, and in `loader.producers` and
    `loader.gpu_producers`); on the host, 4 CPU producers.

    With GPU producers, `mps="auto"` (the default) has this process and its producers share the
    GPU through CUDA's Multi-Process Service, so the producers' decoding and your model overlap
    instead of taking turns: a running MPS daemon is joined, else a private one is started for
    this process (quit as it exits); without MPS where it cannot be had, logged once. CUDA
    joins MPS only as it starts in a process: create the loader before anything in this process
    uses the GPU (a model's `.cuda()`), or start an MPS daemon before the process. `mps="on"`
    raises `RuntimeError` where MPS cannot be had; `mps="off"` never uses it
    (docs/python.md).

    Batches are made on a thread of the loader's own, up to `prefetch` (2) ahead of the loop
    that takes them, so the next batch is gathered while the model runs on this one; on a GPU
    they are gathered on a CUDA stream of their own, and the batch handed out is safe to use
    on the caller's current stream (which waits for its copies; the memory is kept from reuse
    until the caller's work on it is done). `prefetch=0` gathers each batch when it is asked
    for, on the current stream.

    DataLoader arguments and theirs: `batch_size`, `shuffle` (with `seed`: epoch e uses
    `seed + e`), `drop_last` as there; `num_workers` → `producers`; `prefetch_factor` →
    `prefetch` (batches, not per worker); `pin_memory` as there;
    `collate_fn` and `sampler` → none (batches are stacked by the extension; pass the files in
    the order or subset you want).
    """

    def __init__(self, files, batch_size: int = 32, producers: Optional[int] = None,
                 image_size: int = 224,
                 transform: str = "standard", in_flight: int = 8, max_wait: float = 0.002,
                 timeout: float = 60.0, binary=None, torch: bool = False,
                 max_restarts: int = 8, pin_memory: bool = False, device=None,
                 gpu_producers: Optional[int] = None, shuffle: bool = False,
                 seed: Optional[int] = None, drop_last: bool = False, labels=None,
                 on_error: str = "raise", persistent: bool = False, prefetch: int = 2,
                 mps: str = "auto"):
        import os

        # Paths as the OS has them: str, bytes (decoded as os.fsdecode does, so a name that is
        # not UTF-8 round-trips) or path-like. They reach the farm NUL-terminated, so any name
        # a file can have arrives whole.
        self.files = [os.fsdecode(os.fspath(f)) for f in files]
        for i, f in enumerate(self.files):
            if "\0" in f:
                raise ValueError(f"files[{i}] = {f!r} holds a NUL character: no file can be "
                                 "named so")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: give 1 or more")
        self.batch_size = batch_size
        self.device = None if device is None else str(device)
        if self.device is not None and not self.device.startswith("cuda"):
            raise ValueError(f"device={device!r}: None (host memory) or 'cuda[:N]'")
        self.gpu = 0 if self.device in (None, "cuda") else int(self.device.split(":")[1])
        if gpu_producers and self.device is None:
            raise ValueError("gpu_producers hand over GPU memory: give device='cuda'")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}: 'raise' or 'skip'")
        if mps not in ("auto", "on", "off"):
            raise ValueError(f"mps={mps!r}: 'auto', 'on' or 'off'")
        self.mps = mps
        if labels is not None:
            labels = list(labels)
            if len(labels) != len(self.files):
                raise ValueError(f"{len(labels)} labels for {len(self.files)} files: give one each")
        self.labels = labels
        self.on_error = on_error
        self.command = command(binary)
        if self.device is not None and producers is None and gpu_producers is None:
            # The farm's own mix on a GPU: GPU producers where nvJPEG loads, CPU producers for
            # the other cores.
            producers, gpu_producers = self._default_mix()
            logging.getLogger("tensorport").info(
                "Loader on %s: %d CPU and %d GPU producers (the farm's default mix)",
                self.device, producers, gpu_producers)
        self.gpu_producers = max(0, gpu_producers or 0)
        self.producers = max(0 if self.gpu_producers else 1,
                             min(4 if producers is None else producers, len(self.files) or 1))
        self.image_size = image_size
        self.transform = transform
        self.in_flight = in_flight
        self.max_wait = max_wait
        self.timeout = timeout
        self.torch = torch or pin_memory or self.device is not None
        # Batches in page-locked memory (torch's pinned allocator, which caches the blocks), so
        # `.cuda(non_blocking=True)` is one asynchronous DMA, as the DataLoader's pin_memory.
        self.pin_memory = pin_memory
        self.max_restarts = max_restarts
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.skipped: List[Tuple[str, str]] = []
        self.last_indices = None
        self.classes: Optional[List[str]] = None
        self.producer_pids: List[int] = []
        self.persistent = persistent
        self._made = 0
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: 0 (gather each batch when asked) or more")
        self.prefetch = prefetch
        # With `persistent`: the server, the farm and what reads its output, kept across epochs.
        self._kept: Optional[dict] = None
        self._ending = None  # the thread ending the last epoch's server (`_end_later`)
        if self.device is not None and self.gpu_producers > 0:
            # Now, while CUDA may not have started in this process yet (it joins MPS only then).
            _share_gpu(self.mps, self.gpu)

    @classmethod
    def from_folder(cls, root, **kw) -> "Loader":
        """A loader over an ImageFolder layout: `root/<class>/<image>`, classes sorted by name
        (`loader.classes`), labels their positions; batches are `(images, labels)`."""
        import os

        root = str(root)
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        if not classes:
            raise ValueError(f"{root} has no class folders (ImageFolder layout: root/<class>/<image>)")
        files, labels = [], []
        for c, name in enumerate(classes):
            folder = os.path.join(root, name)
            for f in sorted(os.listdir(folder)):
                if f.lower().endswith(_IMAGE_SUFFIXES):
                    files.append(os.path.join(folder, f))
                    labels.append(c)
        loader = cls(files, labels=labels, **kw)
        loader.classes = classes
        return loader

    def __len__(self) -> int:
        n = len(self.files)
        return n // self.batch_size if self.drop_last else (n + self.batch_size - 1) // self.batch_size

    def _order(self) -> List[int]:
        """This epoch's order of the files."""
        order = list(range(len(self.files)))
        if self.shuffle:
            import random

            seed = None if self.seed is None else self.seed + self.epoch
            random.Random(seed).shuffle(order)
        return order

    def __iter__(self):
        if self.persistent:
            return self._iter_kept()
        return self._iter_once()

    def _default_mix(self) -> Tuple[int, int]:
        """The producers `tensorport farm` starts for a server on this loader's GPU when told
        neither count: `(CPU, GPU)`."""
        import subprocess

        p = subprocess.run([*self.command, "--log", "error", "farm", "--attach", "unused.sock",
                            "--attach-gpu", str(self.gpu), "--input-list", "-",
                            "--print-producers"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True)
        try:
            cpu, gpu = (int(x) for x in p.stdout.split())
        except ValueError:
            raise TensorportError(f"{' '.join(self.command)} could not say its default producers: "
                                  f"{p.stderr.strip() or p.stdout.strip()}") from None
        return cpu, gpu

    def _listing(self, order: List[int]) -> bytes:
        """The files in `order`, each name's bytes ending with a NUL (`farm --null`)."""
        import os

        return b"".join(os.fsencode(self.files[i]) + b"\0" for i in order)

    def _farm_command(self, sock: str, listing: str) -> List[str]:
        """The `tensorport farm` that feeds this loader's server at `sock` the files listed in
        `listing` (`-`: on its standard input, as they come)."""
        return [*self.command, "--log", "warn", "farm", "--attach", sock,
                "--attach-gpu", str(self.gpu), "--null", "--input-list", listing,
                "--producers", str(self.producers), "--gpu-producers", str(self.gpu_producers),
                "--in-flight", str(self.in_flight), "--image-size", str(self.image_size),
                "--transform", self.transform, "--max-restarts", str(self.max_restarts),
                "--stall-secs", str(self.timeout), "--progress", "never",
                "--output", "/dev/stdout"]

    def _server(self, sock: str) -> "Server":
        s = self.image_size
        return Server(sock, slots=self.in_flight, slot_size=3 * s * s * 4,
                      max_sessions=self.producers + self.gpu_producers + 4,
                      cuda_device=None if self.device is None else self.gpu)

    @staticmethod
    def _watch(farm, failures, stderr) -> None:
        """Reads the farm's output on two threads: its failure lines into `failures` (the
        images come through this process's server; the rest is its summary), the end of its
        stderr into `stderr`."""
        import threading

        def watch():
            for line in farm.stdout:
                try:
                    r = json.loads(line)
                    if isinstance(r, dict) and r.get("error"):
                        failures.put((int(r.get("index", -1)), str(r.get("input")),
                                      str(r["error"])))
                except (ValueError, TypeError):
                    continue  # not a result line (the farm's summary)

        def keep_stderr():
            for line in farm.stderr:
                stderr.append(line.decode(errors="replace").rstrip())
                del stderr[:-20]

        threading.Thread(target=watch, daemon=True).start()
        threading.Thread(target=keep_stderr, daemon=True).start()

    def _iter_kept(self):
        """An epoch through the kept farm (started on the first, or again if it has ended):
        this epoch's files go to its standard input, and request ids count on from the last
        epoch's."""
        np = _np()
        order = self._order()
        self.epoch += 1
        self.skipped = []
        kept = self._kept
        if kept is None or kept["farm"].poll() is not None:
            self.close()
            kept = self._kept = self._start_kept()
        base = kept["written"]
        kept["farm"].stdin.write(self._listing(order))
        kept["farm"].stdin.flush()
        kept["written"] += len(order)
        yield from self._yielded(
            lambda stop: self._batches(kept["server"], kept["farm"], kept["stderr"], order,
                                       kept["failures"], np, base, stop), np)

    def _start_kept(self) -> dict:
        import os
        import queue
        import subprocess

        d = _private_dir()
        sock = os.path.join(d, "tp.sock")
        server = self._server(sock)
        farm = subprocess.Popen(
            self._farm_command(sock, "-"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            # The farm, and so its producers, die with this process, even killed.
            env=dict(os.environ, TENSORPORT_FARM_PID=str(os.getpid())),
        )
        self.producer_pids = [farm.pid]
        kept = {"dir": d, "server": server, "farm": farm, "failures": queue.Queue(),
                "stderr": [], "written": 0}
        self._watch(farm, kept["failures"], kept["stderr"])
        return kept

    def close(self) -> None:
        """Ends the producers a `persistent` loader keeps between epochs (they also end when
        the loader is collected, and with this process). Iterating again starts new ones."""
        import shutil

        self._settle()
        kept, self._kept = self._kept, None
        if kept is None:
            return
        try:
            kept["farm"].stdin.close()
        except OSError:
            pass
        self._end_farm(kept["farm"])
        self.producer_pids = []
        kept["server"].drain()
        shutil.rmtree(kept["dir"], ignore_errors=True)

    def _settle(self) -> None:
        """Waits for the last epoch's server to have ended and its folder to be gone."""
        ending, self._ending = self._ending, None
        if ending is not None:
            ending.join()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _iter_once(self):
        import os
        import queue
        import shutil
        import subprocess
        import threading

        np = _np()
        order = self._order()
        self.epoch += 1
        self.skipped = []
        self._settle()
        d = _private_dir()
        whole = False  # every batch handed out
        try:
            sock = os.path.join(d, "tp.sock")
            server = self._server(sock)
            failures: "queue.Queue[Tuple[int, str, str]]" = queue.Queue()
            farm = subprocess.Popen(
                self._farm_command(sock, "-"),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                # The farm, and so its producers, die with this process, even killed.
                env=dict(os.environ, TENSORPORT_FARM_PID=str(os.getpid())),
            )
            # The files in this epoch's order, on the farm's standard input (never on disk): it
            # hands them out in that order, and a request's id is the file's position.
            listing = self._listing(order)

            def feed():
                try:
                    farm.stdin.write(listing)
                    farm.stdin.close()
                except (OSError, ValueError):
                    pass  # the farm ended (or the iteration did); its status says why

            threading.Thread(target=feed, daemon=True).start()
            self.producer_pids = [farm.pid]
            stderr: List[str] = []
            self._watch(farm, failures, stderr)
            try:
                yield from self._yielded(
                    lambda stop: self._batches(server, farm, stderr, order, failures, np, 0,
                                               stop), np)
                whole = True
            finally:
                self._end_farm(farm)
                self.producer_pids = []
                server.drain()
            # The epoch is over for the caller: the server ends (its sessions, the producers'
            # pools and device buffers: up to a few hundred milliseconds on a GPU) and its
            # folder goes on a thread of their own, joined by the next epoch, `close()` and
            # the interpreter's exit.
            ending = [server]
            del server
            self._ending = _end_later(ending, d)
        finally:
            if not whole:
                shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def _end_farm(farm) -> None:
        """Ends the farm; its producers end with it (they asked the kernel for SIGTERM when it
        dies). Nothing it still holds is wanted: this iteration is over."""
        if farm.poll() is None:
            farm.kill()
        farm.wait()

    def _new_batch(self, rows, np):
        """An empty batch of `rows` images, where this loader's batches live."""
        shape = (rows, 3, self.image_size, self.image_size)
        if self.device is not None:
            import torch

            return torch.empty(shape, dtype=torch.float32, device=torch.device("cuda", self.gpu))
        if self.pin_memory:
            import torch

            return torch.empty(shape, dtype=torch.float32, pin_memory=True)
        return np.empty(shape, dtype=np.float32)

    def _fill(self, server, images, start, want):
        """Receives up to `want` images into rows `start..` of `images`; returns
        `(request_id, row)` for the rows written."""
        row = 3 * self.image_size * self.image_size * 4
        if self.device is not None:
            import torch

            address = images.data_ptr() + start * row
            try:
                got = server._native._recv_into_device(
                    address, want, row,
                    torch.cuda.current_stream(images.device).cuda_stream, 0.2,
                    self.max_wait)
            except TensorportError as e:
                if "quarantined" in str(e):
                    # Copies may still write it: never freed, never reused.
                    _QUARANTINED.append(images)
                raise
        else:
            address = (images.data_ptr() if self.pin_memory else images.ctypes.data) + start * row
            got = server._native._recv_into_address(address, want, row, 0.2, self.max_wait)
        return [(rid, start + k) for rid, k in got]

    def _yielded(self, batches, np):
        """What the iteration yields: the batches `batches(stop)` makes, each with its labels
        or indices. With `prefetch`, they are made on a thread of their own up to `prefetch`
        batches ahead of the caller (which runs its model meanwhile); on a GPU, gathered on a
        stream of their own, which the caller's current stream waits for."""
        if self.prefetch == 0:
            for images, indices in batches(None):
                self.last_indices = indices
                yield self._pair(images, indices, np)
            return
        import queue
        import threading

        ready: "queue.Queue" = queue.Queue(self.prefetch)
        stop = threading.Event()
        side = []  # the gathering thread's CUDA stream

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        self._made = 0  # batches made this epoch (those taken and those ahead)

        def hand_over() -> bool:
            for batch in batches(stop):
                self._made += 1
                if not put(("batch", batch)):
                    return False
            return True

        def make():
            try:
                if self.device is None:
                    if not hand_over():
                        return
                else:
                    import torch

                    torch.cuda.set_device(self.gpu)
                    side.append(torch.cuda.Stream(self.gpu))
                    # Batches are allocated and written on this thread's stream, so gathering
                    # one never waits for the model's work on the caller's stream.
                    with torch.cuda.stream(side[0]):
                        if not hand_over():
                            return
                put(("end", None))
            except BaseException as e:  # the caller raises it
                put(("error", e))

        thread = threading.Thread(target=make, name="tensorport-loader", daemon=True)
        thread.start()
        try:
            while True:
                kind, item = ready.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                images, indices = item
                if self.device is not None:
                    import torch

                    current = torch.cuda.current_stream(images.device)
                    current.wait_stream(side[0])
                    # The caching allocator keeps the memory from the gathering stream until
                    # the caller's work on it is done.
                    images.record_stream(current)
                self.last_indices = indices
                yield self._pair(images, indices, np)
        finally:
            # The thread sees `stop` after the fill it is in (0.2 s at most); it is joined
            # before the farm is ended or the next epoch reads the server.
            stop.set()
            thread.join()

    def _batches(self, server, farm, stderr, order, failures, np, base=0, stop=None):
        """This epoch's batches `(images, indices)`: request ids (and the farm's indices)
        `base + position`; it ends early once `stop` is set."""
        import queue
        import time

        n = len(order)
        done = set()  # positions in `order`
        last = time.monotonic()
        while len(done) < n:
            if stop is not None and stop.is_set():
                return
            want = min(self.batch_size, n - len(done))
            if self.drop_last and want < self.batch_size:
                return
            images = self._new_batch(want, np)
            kept = []  # positions of the rows kept, in row order
            while len(kept) < want and len(done) < n:
                while True:
                    try:
                        pos, name, error = failures.get_nowait()
                    except queue.Empty:
                        break
                    if not base <= pos < base + n:
                        continue  # an earlier epoch's (its iteration was left early)
                    if self.on_error == "raise":
                        raise TensorportError(f"a file could not be prepared: {name}: {error}")
                    pos -= base
                    if 0 <= pos < n and pos not in done:
                        done.add(pos)
                        # The name as given (the farm's line shows a name that is not UTF-8
                        # with replacement characters).
                        self.skipped.append((self.files[order[pos]], error))
                if len(done) >= n:
                    break
                start = len(kept)
                got = self._fill(server, images, start, min(want - start, n - len(done)))
                if stop is not None and stop.is_set():
                    return
                if not got:
                    if farm.poll() is not None and len(done) < n and failures.empty():
                        if farm.returncode in (130, -signal.SIGINT):
                            # Ctrl-C reached the farm, which drained and quit, and this
                            # process, whose KeyboardInterrupt may not be raised yet: the
                            # iteration was interrupted, not broken.
                            raise KeyboardInterrupt
                        time.sleep(0.2)  # its last lines may still be on their way
                        if failures.empty():
                            raise TensorportError(
                                f"{n - len(done)} of {n} images never came: the producers' farm "
                                f"ended (exit {farm.returncode}): " + " | ".join(stderr[-5:]))
                    if time.monotonic() - last > self.timeout:
                        raise TensorportError(
                            f"{n - len(done)} of {n} images never came within {self.timeout} s")
                    continue
                last = time.monotonic()
                # A file handed over twice (its producer killed after its hand-off, or a second
                # copy given to an idle producer at the end of the queue: both copies may come
                # in one fill) is kept once. Ids outside this epoch's are an earlier one's,
                # left early: not this epoch's.
                fresh = []
                for rid, r in got:
                    pos = rid - base
                    if 0 <= pos < n and pos not in done:
                        done.add(pos)
                        fresh.append((pos, r))
                rows = [r for _, r in fresh]
                if rows != list(range(start, start + len(rows))):
                    images[start:start + len(rows)] = images[self._index(images, rows)]
                kept += [rid for rid, _ in fresh]
            if not kept:
                continue
            if self.drop_last and len(kept) < self.batch_size:
                return
            images = images[:len(kept)]
            yield images, np.array([order[pos] for pos in kept], dtype=np.int64)

    def _index(self, images, rows):
        if self.device is not None:
            import torch

            return torch.tensor(rows, device=images.device)
        return rows

    def _pair(self, images, indices, np):
        """What a batch yields: (images, labels) with labels, else (images, indices)."""
        second = indices if self.labels is None else np.array(
            [self.labels[i] for i in indices.tolist()], dtype=np.int64)
        if self.pin_memory or self.device is not None or self.torch:
            import torch

            if not isinstance(images, torch.Tensor):
                images = torch.from_numpy(images)
            return images, torch.from_numpy(second)
        return images, second
