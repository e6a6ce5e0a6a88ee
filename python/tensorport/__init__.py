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


from ._loader import Loader  # noqa: E402  (it uses the classes above)
