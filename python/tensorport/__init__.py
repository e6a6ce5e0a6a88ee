"""tensorport for Python: zero-copy tensor hand-off between processes.

A `Producer` lends slots of its shared-memory pool as writable numpy arrays and submits them
to a server (a Rust `tensorport serve`, or a `Server` in a Python process); a `Server` hands
each submitted tensor to Python as a read-only numpy view, in place, and sends the answer back
to the producer that asked. See docs/python.md.

    import numpy as np, tensorport

    with tensorport.Producer("/run/user/1000/tensorport/tensorport.sock") as p:
        with p.loan() as slot:
            x = slot.array(np.float32, (3, 224, 224))   # the pool's memory, no copy
            x[:] = image
            slot.submit()
        request_id, answer = p.recv()
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import signal
from typing import Iterator, List, Optional, Sequence, Tuple

from . import _native
from ._native import PROTOCOL_VERSION, TensorportError

# A daemon thread blocked in a native call (`Server.recv_batch`, say) when the interpreter exits
# must not take the GIL back: the native side parks it once this has run.
atexit.register(_native._interpreter_exiting)

__all__ = [
    "Loader",
    "Producer",
    "Loan",
    "Server",
    "Request",
    "TensorportError",
    "PROTOCOL_VERSION",
    "default_socket",
    "command",
]

# tensorport dtype names and numpy's.
_TO_NUMPY = {
    "f32": "float32",
    "f16": "float16",
    "f64": "float64",
    "u8": "uint8",
    "i8": "int8",
    "i32": "int32",
    "i64": "int64",
}
_FROM_NUMPY = {v: k for k, v in _TO_NUMPY.items()}


def default_socket() -> str:
    """Where servers listen unless told otherwise (`TENSORPORT_SOCKET`, then
    `$XDG_RUNTIME_DIR/tensorport/tensorport.sock`, then `/tmp/tensorport-<uid>/tensorport.sock`):
    the same path `tensorport serve` uses."""
    return str(_native.default_socket())


def _np():
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - numpy is a dependency of the views only
        raise ImportError("tensorport's array views need numpy (pip install numpy)") from e
    return numpy


def _tp_dtype(dtype) -> str:
    """The tensorport name of a numpy dtype (or a tensorport name given as is)."""
    if isinstance(dtype, str) and dtype in _TO_NUMPY:
        return dtype
    name = _np().dtype(dtype).name
    try:
        return _FROM_NUMPY[name]
    except KeyError:
        raise ValueError(f"dtype {name} has no tensorport equivalent ({', '.join(_FROM_NUMPY)})")


def _view(owner, address: int, nbytes: int, dtype, shape, writable: bool, strides=None):
    """A numpy array over `nbytes` at `address`, keeping `owner` (and so the mapping) alive."""
    np = _np()
    buf = (ctypes.c_char * max(nbytes, 1)).from_address(address)
    buf._owner = owner  # type: ignore[attr-defined]  # the array's base chain holds the owner
    dt = np.dtype(dtype)
    if strides is None:
        count = 1
        for d in shape:
            count *= int(d)
        if count * dt.itemsize > nbytes:
            raise ValueError(
                f"a {dt.name} array of shape {tuple(shape)} needs {count * dt.itemsize} bytes; the slot has {nbytes}"
            )
        a = np.frombuffer(buf, dtype=dt, count=count).reshape(tuple(int(d) for d in shape))
    else:
        base = np.frombuffer(buf, dtype=dt, count=nbytes // dt.itemsize)
        a = np.lib.stride_tricks.as_strided(
            base,
            shape=tuple(int(d) for d in shape),
            strides=tuple(int(s) * dt.itemsize for s in strides),
            writeable=writable,
        )
    if not writable:
        a.flags.writeable = False
    return a


# GPU memory a stream that never drained may still write (see Server._recv_into_device):
# held for the process's life.
_QUARANTINED: list = []


class Loan:
    """A slot of the producer's pool, ours to write until submitted.

    Use it as a context manager: leaving the block without `submit` gives the slot back. The
    views it hands out (`array()`, `buffer()`) are revoked when the loan is submitted or given
    back: a `buffer()` is released (using it raises `ValueError`, as a released memoryview
    does) and an `array()` becomes read-only, so a view kept too long cannot write into the next
    tensor of the slot. (Views you derive from them yourself — a slice of the array, a numpy array
    over the buffer — are not revoked: do not keep those past the loan.) A loan dropped without
    `with` or `submit` gives its slot back too, whatever views of it exist.
    """

    def __init__(self, producer: "Producer", native):
        self._producer = producer
        self._native = native
        self._spec: Optional[Tuple[str, Tuple[int, ...]]] = None
        self._handed: list = []

    @property
    def nbytes(self) -> int:
        """The slot's size in bytes: the most a tensor written into it may take."""
        return self._native.len

    @property
    def submitted(self) -> bool:
        """Whether the loan was submitted or given back (its views are revoked then)."""
        return self._native.submitted

    def _check_open(self) -> None:
        if self._native.submitted:
            raise TensorportError("this loan was already submitted or given back")

    def array(self, dtype, shape: Sequence[int]):
        """The slot as a writable numpy array of `dtype` and `shape` (row-major), in place.

        `submit()` then hands exactly that tensor over.
        """
        self._check_open()
        np = _np()
        shape = tuple(int(d) for d in shape)
        dt = np.dtype(dtype)
        count = 1
        for d in shape:
            count *= d
        if count * dt.itemsize > self._native.len:
            raise ValueError(
                f"a {dt.name} array of shape {shape} needs {count * dt.itemsize} bytes; the slot has {self._native.len}"
            )
        # The slot's bytes as one uint8 array, made once per slot and producer (it holds the
        # pool's mapping, never a loan); each call returns a new array over it.
        base = self._producer._slot_bytes(self._native)
        a = base[: count * dt.itemsize].view(dt).reshape(shape)
        self._handed.append(a)
        self._spec = (_tp_dtype(dtype), shape)
        return a

    def buffer(self) -> memoryview:
        """The slot's bytes as a writable memoryview (no numpy needed), released when the loan
        is submitted or given back."""
        self._check_open()
        buf = (ctypes.c_char * self._native.len).from_address(self._native.address)
        buf._owner = self._native.mapping
        mv = memoryview(buf).cast("B")
        self._handed.append(mv)
        return mv

    def _revoke(self) -> None:
        for v in self._handed:
            if isinstance(v, memoryview):
                try:
                    v.release()
                except BufferError:
                    pass  # something was made over it: not ours to revoke
            else:
                v.flags.writeable = False
        self._handed.clear()

    def submit(self, dtype=None, shape: Optional[Sequence[int]] = None, strides=None, offset: int = 0) -> int:
        """Hands the slot to the server; returns the request id.

        Without `dtype` and `shape`, submits what the last `array()` call described.
        """
        if dtype is None or shape is None:
            if self._spec is None:
                raise ValueError("say what the slot holds: submit(dtype, shape), or call array() first")
            dtype, shape = self._spec
        try:
            return self._producer._native.submit(
                self._native, _tp_dtype(dtype), [int(d) for d in shape],
                None if strides is None else [int(s) for s in strides], int(offset),
            )
        finally:
            if self._native.submitted:
                self._revoke()

    def release(self) -> None:
        """Gives the slot back unsubmitted (what leaving a `with` block does)."""
        if not isinstance(self._native, _Spent):
            self._native.release()
        self._revoke()

    def __enter__(self) -> "Loan":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self._native = _Spent(self._native)

    def __del__(self) -> None:
        native = getattr(self, "_native", None)
        if native is not None and not isinstance(native, _Spent):
            native.release()
            self._revoke()


class _Spent:
    """What a loan becomes when its `with` block ends: submitted or given back."""

    def __init__(self, native):
        self.submitted = True
        self.len = native.len
        self.address = native.address
        self.mapping = native.mapping


class Producer:
    """A producer session. `Producer(socket, name="python", slots=0, slot_size=0)`.

    0 asks for the server's default slot count and size. A context manager: leaving it ends the
    session (`close`).
    """

    def __init__(self, socket=None, name: str = "python", slots: int = 0, slot_size: int = 0,
                 rings: bool = True, connect_timeout: float = 10.0):
        socket = default_socket() if socket is None else socket
        self._native = _native.Producer(str(socket), name, slots, slot_size, rings, connect_timeout)
        # Each slot's bytes as a uint8 array over the pool's mapping (see Loan.array).
        self._slots: dict = {}
        # CUDA tensors handed over and not answered yet: kept alive until their results.
        self._held: dict = {}

    def _slot_bytes(self, native):
        a = self._slots.get(native.slot)
        if a is None:
            np = _np()
            buf = (ctypes.c_char * native.len).from_address(native.address)
            buf._owner = native.mapping
            a = np.frombuffer(buf, dtype=np.uint8)
            self._slots[native.slot] = a
        return a

    def loan(self, timeout: float = 10.0) -> Loan:
        """A free slot to write, waiting up to `timeout` seconds (several may be out at once)."""
        return Loan(self, self._native.loan(timeout))

    def submit_array(self, array, timeout: float = 10.0) -> int:
        """Copies a numpy array into a fresh slot and submits it; returns the request id."""
        np = _np()
        a = np.ascontiguousarray(array)
        with self.loan(timeout) as slot:
            slot.array(a.dtype, a.shape)[...] = a
            return slot.submit()

    def send(self, array, timeout: float = 10.0) -> int:
        """Copies a numpy array into a free slot and submits it, in one call; returns the
        request id. For small tensors, where a loan's few Python calls cost more than the copy
        (a loan writes in place, with no copy: better for large ones)."""
        np = _np()
        a = array if isinstance(array, np.ndarray) and array.flags.c_contiguous else np.ascontiguousarray(array)
        return self._native._send(a.ctypes.data, a.nbytes, _tp_dtype(a.dtype), a.shape, timeout)

    def recv_many(self, max: int = 256, timeout: float = 0.0) -> List[Tuple[int, bytes]]:
        """Every result that has arrived (up to `max`), waiting up to `timeout` seconds for the
        first: a list of `(request_id, bytes)`, empty if none came. A failed request raises
        `TensorportError` (with `request_id`); the results before it stay for the next call."""
        return self._native.recv_many(max, timeout)

    def submit_tensor(self, tensor, timeout: float = 10.0) -> int:
        """Hands a torch CUDA tensor over in place (no copy): the allocation it lives in (a
        segment of torch's caching allocator, found with the CUDA driver) is registered with
        the server once, and the tensor is fenced after the work queued on torch's current
        stream. The tensor is kept alive here until its result arrives; after that, work on
        that stream waits for the server's reads before it may overwrite the memory.

        A tensor on the CPU is copied into a slot instead (`submit_array`).
        """
        import torch

        if not tensor.is_cuda:
            return self.submit_array(tensor.numpy())
        name = str(tensor.dtype).replace("torch.", "")
        # torch's dtype names are numpy's, and bfloat16, which numpy lacks.
        tp = {**_FROM_NUMPY, "bfloat16": "bf16"}.get(name)
        if tp is None:
            raise ValueError(f"dtype {tensor.dtype} has no tensorport equivalent")
        strides = None if tensor.is_contiguous() else [int(s) for s in tensor.stride()]
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        rid = self._native._submit_cuda(
            tensor.data_ptr(), tensor.device.index or 0, (tp, [int(d) for d in tensor.shape],
                                                          strides), int(stream), timeout)
        self._held[rid] = tensor
        return rid

    def recv(self, timeout: float = 10.0) -> Tuple[int, bytes]:
        """The next result: `(request_id, bytes)`. A failed request raises `TensorportError`
        (with `code`, `code_name` and `request_id`)."""
        try:
            rid, data = self._native.recv(timeout)
        except TensorportError as e:
            self._held.pop(getattr(e, "request_id", None), None)
            raise
        self._held.pop(rid, None)
        return rid, data

    def recv_array(self, dtype="float32", timeout: float = 10.0):
        """The next result as a numpy array of `dtype`: `(request_id, array)`."""
        rid, data = self.recv(timeout)
        return rid, _np().frombuffer(data, dtype=dtype)

    @property
    def in_flight(self) -> int:
        """Requests submitted whose result has not been received yet."""
        return self._native.in_flight()

    @property
    def slot_size(self) -> int:
        """Bytes in each of the session's slots (the server's choice, at least what was asked)."""
        return self._native.slot_size()

    @property
    def uses_rings(self) -> bool:
        """Whether tensors and results travel on the shared-memory queues (else on the socket)."""
        return self._native.uses_rings()

    def close(self) -> None:
        """Ends the session cleanly; loans still out are revoked. Closing twice is harmless."""
        self._slots.clear()
        self._native.close()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Request:
    """A tensor a producer submitted, seen in place. Answer it once: `respond` or `fail`."""

    def __init__(self, native):
        self._native = native

    request_id = property(lambda self: self._native.request_id,
                          doc="The producer's id for this request (unique within its session).")
    producer = property(lambda self: self._native.producer,
                        doc="The producer's session name, as it gave it at connection.")
    shape = property(lambda self: tuple(self._native.shape), doc="The tensor's shape.")
    nbytes = property(lambda self: self._native.nbytes, doc="The tensor's size in bytes.")
    answered = property(lambda self: self._native.answered,
                        doc="Whether `respond` or `fail` was called.")

    @property
    def dtype(self) -> str:
        """The numpy name of the tensor's dtype (`bf16` has none and stays `"bf16"`)."""
        return _TO_NUMPY.get(self._native.dtype, self._native.dtype)

    device = property(lambda self: self._native.device,
                      doc="Whether the tensor is in a GPU producer's device memory (use `tensor()`).")

    def array(self):
        """The tensor as a read-only numpy array, in the producer's pool (no copy)."""
        n = self._native
        if n.device:
            raise TensorportError("a device tensor (from a GPU producer): use tensor()")
        contiguous = list(n.strides) == _row_major(n.shape)
        return _view(n, n.address, n.nbytes, _TO_NUMPY[n.dtype], n.shape, False,
                     None if contiguous else n.strides)

    def tensor(self):
        """The tensor as a torch tensor, in place: a host one over the pool, or — for a GPU
        producer's tensor (a server made with `cuda_device`) — a CUDA one over the producer's
        buffer, after torch's current stream has been made to wait for the producer's writes.
        Read it on that stream (or copy it) before answering: `respond` releases the buffer
        after the work then enqueued there."""
        import torch

        n = self._native
        if not n.device:
            import warnings

            # The view is read-only; torch has no read-only tensors and would say so each time.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(self.array())
        n._wait_ready(torch.cuda.current_stream().cuda_stream)
        contiguous = list(n.strides) == _row_major(n.shape)
        dt = _np().dtype(_TO_NUMPY[n.dtype])
        item = dt.itemsize
        # Marked writable because torch has no read-only tensors; do not write it.
        iface = {
            "shape": tuple(n.shape),
            "typestr": dt.str,
            "data": (n.address, False),
            "version": 3,
            "strides": None if contiguous else tuple(int(x) * item for x in n.strides),
            "stream": None,
        }
        holder = type("_DeviceView", (), {"__cuda_array_interface__": iface, "_owner": n})()
        return torch.as_tensor(holder, device="cuda")

    def _stream(self) -> int:
        """Torch's current stream for a device tensor's release (0 if torch is not in use)."""
        import sys

        torch = sys.modules.get("torch")
        if self._native.device and torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_stream().cuda_stream
        return 0

    def respond(self, data) -> None:
        """Sends `data` (bytes, or anything with a buffer, e.g. a numpy array) as the result.
        A device tensor's buffer goes back after the work enqueued so far on torch's current
        stream."""
        if hasattr(data, "tobytes"):
            data = data.tobytes()
        self._native.respond(bytes(data), self._stream())

    def fail(self, message: str) -> None:
        """Answers with an error: the producer's `recv` raises `TensorportError(message)`."""
        self._native.fail(message, self._stream())


def _row_major(shape) -> list:
    out, acc = [], 1
    for d in reversed(list(shape)):
        out.append(acc)
        acc *= int(d)
    return list(reversed(out))


class Server:
    """A tensorport server in this process: `Server(socket, slots=8, slot_size=1 << 20)`.

    Producers (Rust or Python) connect to `socket`; `recv_batch` hands their tensors over.
    With `cuda_device=N`, producers' pools are pinned for GPU N and their device buffers (GPU
    producers' tensors) are accepted, opened in this process's context (the one torch uses).
    """

    def __init__(self, socket=None, slots: int = 8, slot_size: int = 1 << 20, consumers: int = 1,
                 max_sessions: int = 64, cuda_device: Optional[int] = None):
        socket = default_socket() if socket is None else socket
        self._native = _native.Server(str(socket), slots, slot_size, consumers, max_sessions,
                                      cuda_device)

    @property
    def socket(self):
        """The path producers connect to."""
        return self._native.socket

    def recv_batch(self, max: int = 32, timeout: float = 1.0, max_wait: float = 0.005):
        """Up to `max` requests: waits `timeout` seconds for the first, `max_wait` for more."""
        return [Request(r) for r in self._native.recv_batch(max, timeout, max_wait)]

    def requests(self, timeout: float = 1.0) -> Iterator[Request]:
        """Requests one at a time, until the server stops (after `drain`, once all have left)."""
        while True:
            try:
                batch = self.recv_batch(1, timeout, 0.0)
            except TensorportError:
                return
            yield from batch

    @property
    def sessions(self) -> int:
        """Producer sessions open now."""
        return self._native.sessions()

    def totals(self) -> dict:
        """Server-wide counts: `{"submitted": ..., "completed": ..., "protocol_errors": ...}`."""
        return self._native.totals()

    def drain(self) -> None:
        """Refuses new producers and tells the open ones to finish; `requests` then ends once
        every session has left."""
        self._native.drain()


def command(binary=None) -> List[str]:
    """The command line that runs `tensorport` (the `Loader`'s farm and its producers, the tests'
    servers): `[binary]` if given (a path, or a command as a list), else `[$TENSORPORT_BIN]` if
    set, else the executable a wheel may carry (`tensorport/bin/tensorport`: the CUDA build, put
    there by `scripts/build-wheel.sh --cuda`), else the command line compiled into this package's
    extension: `[sys.executable, "-m", "tensorport"]`. Raises `TensorportError` for a path that
    is not an executable file."""
    import os
    import sys

    if binary is not None and not isinstance(binary, (str, bytes, os.PathLike)):
        cmd = [os.fsdecode(os.fspath(a)) for a in binary]
        if not cmd:
            raise ValueError("binary=[]: give a path or a command")
        return cmd
    given = binary if binary is not None else os.environ.get("TENSORPORT_BIN")
    if given:
        path = os.fsdecode(os.fspath(given))
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            what = "binary=" if binary is not None else "TENSORPORT_BIN="
            raise TensorportError(f"{what}{path} is not an executable file (leave it unset to use "
                                  "the command line this package carries)")
        return [path]
    carried = _carried_binary()
    if carried:
        return [carried]
    return [sys.executable, "-m", "tensorport"]


def _carried_binary() -> Optional[str]:
    """The executable the wheel carries (`tensorport/bin/tensorport`), if any."""
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "tensorport")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


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

    DataLoader arguments and theirs: `batch_size`, `shuffle` (with `seed`: epoch e uses
    `seed + e`), `drop_last` as there; `num_workers` → `producers`; `pin_memory` as there;
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
                 on_error: str = "raise", persistent: bool = False):
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
        # With `persistent`: the server, the farm and what reads its output, kept across epochs.
        self._kept: Optional[dict] = None

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
        yield from self._batches(kept["server"], kept["farm"], kept["stderr"], order,
                                 kept["failures"], np, base)

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
        d = _private_dir()
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
                yield from self._batches(server, farm, stderr, order, failures, np)
            finally:
                self._end_farm(farm)
                self.producer_pids = []
                server.drain()
        finally:
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

    def _batches(self, server, farm, stderr, order, failures, np, base=0):
        """This epoch's batches: request ids (and the farm's indices) `base + position`."""
        import queue
        import time

        n = len(order)
        done = set()  # positions in `order`
        last = time.monotonic()
        while len(done) < n:
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
                # A file handed over twice (its producer killed after its hand-off) is kept once.
                # Ids outside this epoch's are an earlier one's, left early: not this epoch's.
                fresh = [(rid - base, r) for rid, r in got
                         if 0 <= rid - base < n and rid - base not in done]
                done.update(rid for rid, _ in fresh)
                rows = [r for _, r in fresh]
                if rows != list(range(start, start + len(rows))):
                    images[start:start + len(rows)] = images[self._index(images, rows)]
                kept += [rid for rid, _ in fresh]
            if not kept:
                continue
            if self.drop_last and len(kept) < self.batch_size:
                return
            images = images[:len(kept)]
            indices = np.array([order[pos] for pos in kept], dtype=np.int64)
            self.last_indices = indices
            yield self._pair(images, indices, np)

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
