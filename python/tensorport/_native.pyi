"""Types of `tensorport._native`, the package's extension (crates/tensorport-py). Use the
package's own classes (`tensorport.Producer`, `tensorport.Server`, …); these are what they wrap.
Blocking calls release the GIL; timeouts are in seconds."""

from os import PathLike
from typing import Dict, List, Optional, Sequence, Tuple, Union

PROTOCOL_VERSION: int

class TensorportError(Exception):
    """A tensorport failure; `code` is the protocol's error code (a number) and `code_name`
    its name, where there is one."""

    code: Optional[int]
    code_name: Optional[str]

def default_socket() -> PathLike[str]: ...
def _cli_main(args: List[str], launcher: List[str]) -> int: ...
def _interpreter_exiting() -> None:
    """Marks the interpreter as exiting: native calls that return on other threads then park."""
    ...


class Mapping:
    """Keeps a producer's pool mapped while any view of it lives."""

class Loan:
    """A slot of a producer's pool, lent for writing until it is submitted or released."""

    slot: int
    address: int
    len: int
    @property
    def submitted(self) -> bool: ...
    @property
    def mapping(self) -> Mapping: ...
    def release(self) -> None: ...

class Producer:
    def __init__(
        self,
        socket: Union[str, PathLike[str]],
        name: str = "python",
        slots: int = 0,
        slot_size: int = 0,
        rings: bool = True,
        connect_timeout: float = 10.0,
    ) -> None: ...
    def loan(self, timeout: float = 10.0) -> Loan: ...
    def submit(
        self,
        loan: Loan,
        dtype: str,
        shape: Sequence[int],
        strides: Optional[Sequence[int]] = None,
        offset: int = 0,
    ) -> int: ...
    def _submit_cuda(
        self,
        ptr: int,
        device: int,
        spec: Tuple[str, Sequence[int], Optional[Sequence[int]]],
        stream: int = 0,
        timeout: float = 10.0,
    ) -> int: ...
    def recv(self, timeout: float = 10.0) -> Tuple[int, bytes]: ...
    def _send(
        self, address: int, nbytes: int, dtype: str, shape: Sequence[int], timeout: float = 10.0
    ) -> int: ...
    def recv_many(self, max: int = 256, timeout: float = 0.0) -> List[Tuple[int, bytes]]: ...
    def in_flight(self) -> int: ...
    def slot_size(self) -> int: ...
    def uses_rings(self) -> bool: ...
    def close(self) -> None: ...

class Request:
    """A submitted tensor, viewed in place until it is answered."""

    request_id: int
    producer: str
    dtype: str
    shape: List[int]
    strides: List[int]
    address: int
    nbytes: int
    device: bool
    @property
    def answered(self) -> bool: ...
    def _wait_ready(self, stream: int) -> None: ...
    def respond(self, data: bytes, stream: int = 0) -> None: ...
    def fail(self, message: str, stream: int = 0) -> None: ...

class Mps:
    def __init__(self, mode: str, gpus: List[int]) -> None: ...
    @property
    def env(self) -> Dict[str, str]: ...
    @property
    def why_off(self) -> Optional[str]: ...
    def describe(self) -> str: ...
    def close(self) -> None: ...
    def quit_at_exit(self) -> None: ...

class Server:
    def __init__(
        self,
        socket: Union[str, PathLike[str]],
        slots: int = 8,
        slot_size: int = 1 << 20,
        consumers: int = 1,
        max_sessions: int = 64,
        cuda_device: Optional[int] = None,
    ) -> None: ...
    def recv_batch(
        self, max: int = 32, timeout: float = 1.0, max_wait: float = 0.005
    ) -> List[Request]: ...
    def _recv_into_address(
        self,
        address: int,
        rows: int,
        row: int,
        timeout: float = 1.0,
        max_wait: float = 0.005,
    ) -> List[Tuple[int, int]]: ...
    def _recv_into_device(
        self,
        address: int,
        rows: int,
        row: int,
        stream: int,
        timeout: float = 1.0,
        max_wait: float = 0.005,
    ) -> List[Tuple[int, int]]: ...
    def _ack_batch(self, max: int = 64, timeout: float = 1.0) -> Tuple[int, int]: ...
    def sessions(self) -> int: ...
    def totals(self) -> Dict[str, int]: ...
    def drain(self) -> None: ...
    @property
    def socket(self) -> PathLike[str]: ...
