"""The Python package against real processes: the `tensorport` command line (`tensorport.command()`)
as the server or the producers, and Python processes killed with SIGKILL."""

import json
import os
import shutil
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import tensorport
from tensorport import Producer, Server, TensorportError

# Found the way users' code finds it (TENSORPORT_BIN only overrides): from an installed wheel,
# `python -m tensorport`, the command line compiled into the extension.
CMD = tensorport.command()
PATIENCE = 60.0


def eventually(cond, timeout=PATIENCE):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def run(*args, **kw):
    return subprocess.run([*CMD, "--log", "warn", *args], check=True, capture_output=True, text=True, **kw)


@pytest.fixture
def sock(tmp_path):
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    return d / "tp.sock"


@pytest.fixture
def rust_server(sock):
    """`tensorport serve` (the bundled classifier, 32x32 inputs), up when yielded."""
    p = subprocess.Popen([*CMD, "--log", "warn", "serve", "--socket", str(sock), "--image-size", "32"],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("ready"), line
    yield sock
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=PATIENCE)


def read_safetensors(path):
    """name -> float32 array, from a safetensors file (its format: u64 header length, JSON)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        assert meta["dtype"] == "F32"
        out[name] = np.frombuffer(data[a:b], dtype=np.float32).reshape(meta["shape"])
    return out


def answering_server(sock, answer, **kw):
    """A Python Server whose consumer thread answers each request with `answer(request)`; a
    request for which `answer` raises ValueError is failed with its message."""
    srv = Server(sock, **kw)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            for r in srv.recv_batch(16, timeout=0.05):
                try:
                    try:
                        data = answer(r)
                    except ValueError as e:
                        r.fail(str(e) or "refused")
                        continue
                    r.respond(data)
                except TensorportError:
                    pass  # the producer left

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, stop


def test_python_producer_into_the_rust_server_answers_as_the_rust_producer(tmp_path, rust_server):
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "6")
    # The Rust producer's answers for those files...
    out = run("produce", "--socket", str(rust_server), "--input", str(images), "--image-size", "32").stdout
    rust = {json.loads(l)["input"].rsplit("/", 1)[-1]: json.loads(l)["scores"] for l in out.splitlines() if l.strip()}
    assert len(rust) == 6
    # ...and the Python producer's, for the tensors the Rust preprocessing makes of them.
    dump = tmp_path / "tensors.safetensors"
    run("prep", "--input", str(images), "--image-size", "32", "--dump", str(dump))
    tensors = read_safetensors(dump)
    assert set(tensors) == set(rust)
    with Producer(rust_server, name="python") as p:
        for name, x in sorted(tensors.items()):
            with p.loan() as slot:
                slot.array(np.float32, x.shape)[...] = x
                rid = slot.submit()
            got_id, scores = p.recv_array(np.float32)
            assert got_id == rid
            np.testing.assert_array_equal(scores, np.float32(rust[name]), err_msg=name)


def test_rust_producers_into_a_python_server_every_input_once(sock):
    seen = {}
    lock = threading.Lock()

    def answer(r):
        x = r.array()
        assert x.shape == (3, 32, 32) and r.dtype == "float32"
        assert not x.flags.writeable
        with lock:
            seen[(r.producer, r.request_id)] = seen.get((r.producer, r.request_id), 0) + 1
        return np.float32([x.mean(), x.min(), x.max()])

    srv, stop = answering_server(sock, answer, slot_size=3 * 32 * 32 * 4)
    procs = [subprocess.Popen([*CMD, "--log", "warn", "produce", "--socket", str(sock), "--synthetic", "40",
                               "--image-size", "32", "--name", f"rust-{i}"], stdout=subprocess.PIPE, text=True)
             for i in range(3)]
    lines = []
    for p in procs:
        out, _ = p.communicate(timeout=PATIENCE)
        assert p.returncode == 0
        lines += [json.loads(l) for l in out.splitlines() if l.strip()]
    stop.set()
    assert len(lines) == 120
    for l in lines:
        assert l.get("error") is None, l
        mean, lo, hi = l["scores"]
        assert lo <= mean <= hi
    per_producer = {}
    for (name, _), n in seen.items():
        assert n == 1
        per_producer[name] = per_producer.get(name, 0) + 1
    assert per_producer == {"rust-0": 40, "rust-1": 40, "rust-2": 40}
    t = srv.totals()
    assert t["submitted"] == t["completed"] == 120


def test_several_loans_out_at_once_and_results_checked(sock):
    srv, stop = answering_server(sock, lambda r: np.float64([r.array().astype(np.float64).sum()]))
    with Producer(sock, slots=4) as p:
        for round_ in range(20):
            slots = [p.loan() for _ in range(4)]
            want = {}
            for k, s in enumerate(slots):
                a = s.array(np.int32, (64, 16))
                a[...] = np.arange(64 * 16, dtype=np.int32).reshape(64, 16) * (round_ + k)
                want[s.submit()] = float(a.sum())
            for _ in range(4):
                rid, got = p.recv_array(np.float64)
                assert got[0] == want.pop(rid)
        assert p.in_flight == 0
    stop.set()


def test_send_copies_in_one_call_and_recv_many_takes_what_came(sock):
    # The server sums each tensor, and fails those whose first element is negative.
    def answer(r):
        a = r.array()
        if a.flat[0] < 0:
            raise ValueError("negative")
        return np.float64([a.astype(np.float64).sum()])

    srv, stop = answering_server(sock, answer)
    with Producer(sock, slots=8, slot_size=4096) as p:
        want = {}
        for i in range(200):
            a = np.arange(16, dtype=np.float32).reshape(4, 4) * i
            want[p.send(a)] = float(a.sum())
            if p.in_flight >= 8:
                for rid, data in p.recv_many(timeout=5):
                    assert np.frombuffer(data, np.float64)[0] == want.pop(rid)
        while p.in_flight:
            for rid, data in p.recv_many(timeout=5):
                assert np.frombuffer(data, np.float64)[0] == want.pop(rid)
        assert not want
        assert p.recv_many() == []
        # Non-contiguous input is copied contiguous first; the wrong size for a slot is refused.
        p.send(np.arange(64, dtype=np.int32).reshape(8, 8)[:, ::2])
        p.recv(timeout=5)
        with pytest.raises(TensorportError) as e:
            p.send(np.zeros(2048, dtype=np.float32))
        assert e.value.code_name == "OutOfBounds"
        # A failure after good results: the good ones come back, the failure is raised next.
        good = p.send(np.ones(4, dtype=np.float32))
        bad = p.send(-np.ones(4, dtype=np.float32))
        got = p.recv_many(timeout=5)
        assert [rid for rid, _ in got] == [good]
        with pytest.raises(TensorportError) as e:
            p.recv_many(timeout=5)
        assert e.value.request_id == bad
        assert p.in_flight == 0
    stop.set()


def test_python_producers_of_any_tensor_into_the_rust_sink_server(sock):
    # `tensorport serve --sink`: a Rust server that answers every tensor at once, whatever its
    # dtype and shape; the transport's checks still hold (a tensor larger than a slot).
    srv = subprocess.Popen([*CMD, "--log", "warn", "serve", "--sink", "--socket", str(sock),
                            "--slot-size", "8192", "--slots", "4"], stdout=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        assert line.startswith("ready"), line
        with Producer(sock, slots=4, slot_size=8192) as p:
            sent = set()
            for i, a in enumerate([np.arange(12, dtype=np.int32).reshape(3, 4),
                                   np.ones((2, 2, 2), dtype=np.float64),
                                   np.zeros(2048, dtype=np.float32),
                                   np.array([i for i in range(7)], dtype=np.uint8)] * 50):
                sent.add(p.send(a, timeout=PATIENCE))
                while p.in_flight >= 4:
                    for rid, data in p.recv_many(timeout=PATIENCE):
                        assert data == b""
                        sent.remove(rid)
            while p.in_flight:
                for rid, data in p.recv_many(timeout=PATIENCE):
                    assert data == b""
                    sent.remove(rid)
            assert not sent
            with pytest.raises(TensorportError) as e:
                p.send(np.zeros(4096, dtype=np.float32))
            assert e.value.code_name == "OutOfBounds"
    finally:
        srv.send_signal(signal.SIGTERM)
        assert srv.wait(timeout=PATIENCE) == 0


def test_misuse_raises_clear_errors(sock):
    srv, stop = answering_server(sock, lambda r: b"")
    with Producer(sock, slots=2, slot_size=4096) as p:
        slot = p.loan()
        with pytest.raises(ValueError, match="needs"):
            slot.array(np.float32, (2048,))  # 8 KiB in a 4 KiB slot
        with pytest.raises(ValueError):
            slot.array(np.complex64, (4,))
        slot.array(np.uint8, (16,))
        slot.submit()
        with pytest.raises(TensorportError, match="already submitted"):
            slot.submit()
        p.recv()
        # Bytes past the slot: refused before sending, with the protocol's code.
        slot = p.loan()
        with pytest.raises(TensorportError) as e:
            slot.submit("f32", (2048,))
        assert e.value.code_name == "OutOfBounds"
        # A loan of another producer.
        with Producer(sock) as q:
            theirs = q.loan()
            with pytest.raises(TensorportError, match="another producer"):
                p._native.submit(theirs._native, "u8", [1], None, 0)
    stop.set()


def test_answering_twice_and_timeouts(tmp_path):
    sock = tmp_path / "t.sock"
    srv = Server(sock)
    with Producer(sock) as p:
        with pytest.raises(TensorportError, match="no request is in flight"):
            p.recv(timeout=0.05)
        with p.loan() as slot:
            slot.array(np.uint8, (8,))[...] = 7
            slot.submit()
        with pytest.raises(TimeoutError):
            p.recv(timeout=0.05)  # in flight, not answered yet
        (r,) = srv.recv_batch(1, timeout=PATIENCE)
        assert r.array().tolist() == [7] * 8
        r.respond(b"ok")
        with pytest.raises(TensorportError, match="already answered"):
            r.respond(b"again")
        assert p.recv()[1] == b"ok"
        # A request failed by the server arrives as an exception carrying its code.
        with p.loan() as slot:
            slot.array(np.uint8, (8,))
            rid = slot.submit()
        (r,) = srv.recv_batch(1, timeout=PATIENCE)
        r.fail("no thanks")
        with pytest.raises(TensorportError, match="no thanks") as e:
            p.recv()
        assert e.value.code_name == "HandlerFailed" and e.value.request_id == rid


CHILD = """
import sys, time, numpy as np, tensorport
p = tensorport.Producer(sys.argv[1], name="doomed", slots=2)
s = p.loan()
s.array(np.float32, (256,))[...] = 1.0
s.submit()
print("submitted", flush=True)
time.sleep(600)
"""


def test_a_killed_python_producer_is_reclaimed(sock):
    srv = Server(sock)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(sock)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ})
    assert child.stdout.readline().strip() == "submitted"
    (r,) = srv.recv_batch(1, timeout=PATIENCE)
    view = r.array()
    child.kill()
    child.wait()
    assert eventually(lambda: srv.sessions == 0)
    assert srv.totals()["sessions_reclaimed"] == 1
    # The view stays readable (the pool stays mapped while it lives); answering is refused.
    assert float(view.sum()) == 256.0
    with pytest.raises(TensorportError):
        r.respond(b"late")
    # And others are served.
    with Producer(sock) as p:
        with p.loan() as slot:
            slot.array(np.uint8, (4,))
            slot.submit()
        (r,) = srv.recv_batch(1, timeout=PATIENCE)
        r.respond(b"x")
        assert p.recv()[1] == b"x"


def test_loader_yields_every_file_once_as_the_rust_preprocessing_makes_it(tmp_path):
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "20")
    files = sorted(images.iterdir())
    dump = tmp_path / "t.safetensors"
    run("prep", "--input", str(images), "--image-size", "32", "--dump", str(dump))
    want = read_safetensors(dump)
    loader = tensorport.Loader(files, batch_size=4, producers=2, image_size=32, binary=CMD)
    assert len(loader) == 5
    got = {}
    for x, idx in loader:
        assert x.dtype == np.float32 and x.shape[1:] == (3, 32, 32) and 1 <= len(x) <= 4
        assert x.flags.writeable  # a copy, the caller's to keep
        for a, i in zip(x, idx.tolist()):
            assert i not in got
            got[i] = a
    assert sorted(got) == list(range(20))
    for i, f in enumerate(files):
        np.testing.assert_array_equal(got[i], want[f.name], err_msg=f.name)


def test_loader_with_a_long_share_per_producer(tmp_path):
    # 1,500 inputs for one producer: its list (over 100 KB) is more than a pipe holds, so it
    # must be fed while the batches are taken (a blocking write once deadlocked here).
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "4")
    files = sorted(images.iterdir()) * 375
    seen = set()
    for x, idx in tensorport.Loader(files, batch_size=64, producers=1, image_size=16,
                                    binary=CMD, timeout=PATIENCE):
        assert len(x) == len(idx)
        seen.update(idx.tolist())
    assert seen == set(range(len(files)))


def test_loader_raises_for_a_file_it_cannot_prepare(tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(TensorportError, match="broken.jpg"):
        for _ in tensorport.Loader([bad], image_size=32, binary=CMD, timeout=PATIENCE):
            pass


def test_loader_on_a_gpu_is_asked_for_clearly(tmp_path):
    with pytest.raises(ValueError, match="cuda"):
        tensorport.Loader(["x.jpg"], device="cpu", binary=CMD)
    with pytest.raises(ValueError, match="device='cuda'"):
        tensorport.Loader(["x.jpg"], gpu_producers=1, binary=CMD)
    # A server that opens device memory needs a driver: without one it says so.
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:
        pass
    with pytest.raises(TensorportError, match="NVIDIA driver"):
        tensorport.Server(str(tmp_path / "g.sock"), cuda_device=0)


def _descendants(root=None, needle=""):
    """Pids of the processes below `root` (this one by default) whose command line contains
    `needle`."""
    parents, cmds = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            cmds[int(d)] = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    below, frontier = set(), {os.getpid() if root is None else root}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return sorted(p for p in below if needle in cmds.get(p, ""))


def _gone(pid):
    """Whether process `pid` has ended (a zombie waiting for init to reap it counts)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_loader_restarts_a_killed_producer_every_file_once(tmp_path):
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "60")
    files = sorted(images.iterdir())
    seen = []
    killed = False
    for x, idx in tensorport.Loader(files, batch_size=4, producers=2, image_size=32, binary=CMD,
                                    in_flight=2):
        seen += idx.tolist()
        if not killed:
            victims = _descendants(needle="producer-1")
            assert victims, "no producer to kill"
            os.kill(victims[0], signal.SIGKILL)
            killed = True
    assert killed
    assert sorted(seen) == list(range(60)), sorted(seen)


def test_a_server_killed_under_a_waiting_recv_and_a_property_read_never_deadlocks(sock):
    """A request in flight to a stopped server; one thread waits for its result in `recv`,
    another reads `in_flight` and `slot_size`: the interpreter stays free (the main thread still
    runs), and when the server is SIGKILLed `recv` raises and both threads end. The scenario
    runs in a child process under a watchdog, so a deadlock fails the test instead of hanging
    it."""
    import select
    srv = subprocess.Popen([*CMD, "--log", "warn", "serve", "--sink", "--socket", str(sock)],
                           stdout=subprocess.PIPE, text=True)
    script = f"""
import sys, threading, time
import numpy as np
import tensorport
p = tensorport.Producer({str(sock)!r}, name="gil")
# One round trip while the server runs: the producer then holds its slots.
p.send(np.zeros(16, dtype=np.float32))
p.recv(timeout=30)
print("connected", flush=True)
sys.stdin.readline()  # the server is stopped now
p.send(np.zeros(16, dtype=np.float32))
errors, done = [], threading.Event()
def waiter():
    try:
        p.recv(timeout=60)
    except Exception as e:
        errors.append(type(e).__name__)
    done.set()
def reader():
    while not done.is_set():
        try:
            p.in_flight; p.slot_size
        except Exception as e:  # the session is gone: a clear error, then stop
            errors.append("reader " + type(e).__name__)
            return
threads = [threading.Thread(target=waiter), threading.Thread(target=reader)]
for t in threads:
    t.start()
time.sleep(0.5)
print("ready", flush=True)  # needs the GIL while both threads are in the extension
for t in threads:
    t.join()
print("done", errors, flush=True)
"""
    child = None
    try:
        assert srv.stdout.readline().startswith("ready")
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)

        def line(what):
            r, _, _ = select.select([child.stdout], [], [], PATIENCE)
            if not r:
                pytest.fail(f"no '{what}' from the child in {PATIENCE} s: its interpreter is stuck")
            return child.stdout.readline()

        assert line("connected").startswith("connected")
        srv.send_signal(signal.SIGSTOP)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert line("ready").startswith("ready")
        srv.kill()
        out = line("done")
        assert out.startswith("done") and "'TensorportError'" in out, out
        assert child.wait(timeout=PATIENCE) == 0
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        srv.kill()
        srv.wait()


def test_views_are_revoked_with_their_loan_and_never_hold_a_slot(sock):
    """A view kept past its loan cannot write into the next tensor of the slot: a `buffer()`
    raises once its loan is submitted or given back, an `array()` turns read-only. And views
    never keep a slot leased: with 4 slots, loans given back (by `with` or by being dropped)
    while their views live make room for the next loans."""
    srv, stop = answering_server(sock, lambda r: r.array().reshape(-1)[:1].tobytes(), slots=4, slot_size=4096)
    try:
        with Producer(sock, name="views") as p:
            # Submitted: the buffer is released, the array read-only.
            slot = p.loan()
            buf = slot.buffer()
            arr = slot.array(np.uint8, (16,))
            arr[:] = 3
            slot.submit()
            with pytest.raises(ValueError):
                buf[0] = 9
            with pytest.raises(ValueError):
                arr[0] = 9
            assert p.recv(timeout=PATIENCE)[1] == b"\x03"
            # The next loans of the same slots carry what they were given, not stale writes.
            for k in range(8):
                with p.loan() as s2:
                    s2.array(np.uint8, (16,))[:] = k
                    s2.submit()
                assert p.recv(timeout=PATIENCE)[1] == bytes([k])
            # Unsubmitted loans whose views are kept: their slots come back all the same.
            kept = []
            for _ in range(8):
                with p.loan(timeout=5) as s3:
                    kept.append(s3.array(np.float32, (4,)))
                    kept.append(s3.buffer())
            for _ in range(8):
                s4 = p.loan(timeout=5)
                kept.append(s4.array(np.uint8, (4,)))
                del s4  # dropped without `with` or submit
            assert all(not v.flags.writeable for v in kept if isinstance(v, np.ndarray))
            with pytest.raises(ValueError):
                kept[1][0] = 1
            with pytest.raises(TensorportError, match="already submitted or given back"):
                with p.loan() as s5:
                    pass
                s5.array(np.uint8, (4,))
    finally:
        stop.set()


def test_the_package_runs_its_own_tensorport_command():
    """`python -m tensorport` and, installed, the `tensorport` command run the command line
    compiled into the extension: no Rust toolchain, no executable of its own."""
    import shutil

    env = {k: v for k, v in os.environ.items() if k != "TENSORPORT_BIN"}
    out = subprocess.run([sys.executable, "-m", "tensorport", "--version"], check=True,
                         capture_output=True, text=True, timeout=PATIENCE, env=env)
    assert out.stdout.startswith("tensorport "), out.stdout
    bad = subprocess.run([sys.executable, "-m", "tensorport", "farm", "--no-such-flag"],
                         capture_output=True, text=True, timeout=PATIENCE, env=env)
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr, bad
    script = shutil.which("tensorport")
    if script is None or os.path.dirname(script) != os.path.dirname(sys.executable):
        pytest.skip("the `tensorport` command comes with an installed package (this run uses the sources)")
    out = subprocess.run([script, "images", "--help"], check=True, capture_output=True, text=True,
                         timeout=PATIENCE, env=env)
    assert "sample" in out.stdout.lower(), out.stdout


def test_the_command_is_the_packages_own_unless_told(tmp_path, monkeypatch):
    """With nothing set the package runs its own command line; `TENSORPORT_BIN` or `binary=`
    name an executable instead, and one that is not there is an error that says so."""
    monkeypatch.delenv("TENSORPORT_BIN", raising=False)
    if tensorport._carried_binary() is None:
        assert tensorport.command() == [sys.executable, "-m", "tensorport"]
    assert tensorport.command(["python3", "-m", "tensorport"]) == ["python3", "-m", "tensorport"]
    missing = str(tmp_path / "no-such-tensorport")
    with pytest.raises(TensorportError, match="binary=.*not an executable file"):
        tensorport.command(missing)
    monkeypatch.setenv("TENSORPORT_BIN", missing)
    with pytest.raises(TensorportError, match="TENSORPORT_BIN=.*not an executable file"):
        tensorport.Loader(["x.jpg"])


def test_loader_epochs_give_full_batches_and_every_file_once(tmp_path):
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "20")
    files = sorted(images.iterdir())
    loader = tensorport.Loader(files, batch_size=6, producers=2, image_size=16, binary=CMD,
                               shuffle=True, seed=7, timeout=PATIENCE)
    assert len(loader) == 4
    for epoch in range(2):
        sizes, seen = [], []
        for x, idx in loader:
            sizes.append(len(x))
            assert len(idx) == len(x)
            seen += idx.tolist()
        assert sizes == [6, 6, 6, 2], (epoch, sizes)
        assert sorted(seen) == list(range(20)), epoch
    # The shuffled order is the seed's: epoch e uses seed + e, the same for every loader.
    again = tensorport.Loader(files, shuffle=True, seed=7, binary=CMD)
    assert again._order() == tensorport.Loader(files, shuffle=True, seed=7, binary=CMD)._order()
    first = again._order()
    again.epoch = 1
    assert again._order() != first and sorted(again._order()) == list(range(20))


def test_a_loader_on_a_gpu_takes_the_farms_default_mix(tmp_path):
    """Given neither count, a loader on a GPU starts the producers `tensorport farm` would for
    a server on that GPU; given either, what it is given; on the host, 4 CPU producers."""
    files = [str(tmp_path / f"{i}.jpg") for i in range(64)]
    out = run("farm", "--attach", "unused.sock", "--attach-gpu", "0", "--input-list", "-",
              "--print-producers").stdout.split()
    farm_mix = (int(out[0]), int(out[1]))
    loader = tensorport.Loader(files, device="cuda", binary=CMD)
    assert (loader.producers, loader.gpu_producers) == farm_mix
    assert loader.producers + loader.gpu_producers >= 1
    given = tensorport.Loader(files, device="cuda", producers=3, binary=CMD)
    assert (given.producers, given.gpu_producers) == (3, 0)
    host = tensorport.Loader(files, binary=CMD)
    assert (host.producers, host.gpu_producers) == (4, 0)


def test_loader_drop_last_leaves_out_the_short_batch(tmp_path):
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "20")
    loader = tensorport.Loader(sorted(images.iterdir()), batch_size=6, producers=2,
                               image_size=16, binary=CMD, drop_last=True, timeout=PATIENCE)
    assert len(loader) == 3
    sizes = [len(x) for x, _ in loader]
    assert sizes == [6, 6, 6]


def test_loader_from_an_image_folder_yields_labels(tmp_path):
    root = tmp_path / "train"
    for name, count in (("cat", "5"), ("dog", "7")):
        run("images", "--out", str(root / name), "--count", count)
    loader = tensorport.Loader.from_folder(root, batch_size=4, producers=2, image_size=16,
                                           binary=CMD, timeout=PATIENCE)
    assert loader.classes == ["cat", "dog"]
    seen = {}
    for x, labels in loader:
        assert len(labels) == len(x) == len(loader.last_indices)
        for label, i in zip(labels.tolist(), loader.last_indices.tolist()):
            seen[i] = label
    assert len(seen) == 12
    for i, label in seen.items():
        assert os.path.basename(os.path.dirname(loader.files[i])) == loader.classes[label]


def test_loader_can_skip_a_file_it_cannot_prepare(tmp_path):
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "6")
    bad = images / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not a jpeg")
    files = sorted(images.iterdir())
    loader = tensorport.Loader(files, batch_size=4, producers=2, image_size=16, binary=CMD,
                               on_error="skip", timeout=PATIENCE)
    seen = [i for _, idx in loader for i in idx.tolist()]
    assert sorted(seen) == [i for i, f in enumerate(files) if f.name != "broken.jpg"]
    assert [os.path.basename(name) for name, _ in loader.skipped] == ["broken.jpg"]
    with pytest.raises(ValueError, match="on_error"):
        tensorport.Loader(files, on_error="ignore", binary=CMD)


def test_loader_keeps_awkward_names_in_place_and_skips_what_is_not_a_file(tmp_path):
    """A name with a newline, one that is not UTF-8 and a FIFO named like an image, in an
    ImageFolder layout, shuffled, skipping errors: every file comes back once, each row is its
    own file's image under its own label, and the FIFO is skipped at once, saying why."""
    root = tmp_path / "train"
    run("images", "--out", str(root / "cat"), "--count", "6")
    dog = root / "dog"
    dog.mkdir()
    (dog / "img04x\nimg05y.png").write_bytes((root / "cat" / "sample-000.png").read_bytes())
    with open(os.path.join(os.fsencode(dog), b"odd-\xff\xfe.png"), "wb") as f:
        f.write((root / "cat" / "sample-002.png").read_bytes())
    os.mkfifo(dog / "fifo.jpg")
    loader = tensorport.Loader.from_folder(root, batch_size=4, producers=2, image_size=16,
                                           binary=CMD, shuffle=True, seed=3, on_error="skip",
                                           timeout=PATIENCE)
    rows = {}
    for x, labels in loader:
        for row, label, i in zip(x, labels.tolist(), loader.last_indices.tolist()):
            f = loader.files[i]
            assert i not in rows, f
            assert loader.classes[label] == os.path.basename(os.path.dirname(f)), f
            rows[i] = (os.path.basename(f), row)
    by_name = {name: row for name, row in rows.values()}
    assert len(rows) == 8, sorted(by_name)
    assert np.array_equal(by_name["img04x\nimg05y.png"], by_name["sample-000.png"])
    assert np.array_equal(by_name[os.fsdecode(b"odd-\xff\xfe.png")], by_name["sample-002.png"])
    assert not np.array_equal(by_name["sample-000.png"], by_name["sample-002.png"])
    assert [os.path.basename(n) for n, _ in loader.skipped] == ["fifo.jpg"]
    assert "a FIFO" in loader.skipped[0][1]
    with pytest.raises(ValueError, match="NUL"):
        tensorport.Loader(["a\0b.jpg"], binary=CMD)


def test_a_killed_python_parent_leaves_no_producer_behind(tmp_path):
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "8")
    script = (
        "import sys, time, tensorport\n"
        "files = sorted(__import__('pathlib').Path(sys.argv[1]).iterdir()) * 500\n"
        "loader = tensorport.Loader(files, batch_size=4, producers=2, image_size=16,\n"
        "                           binary=sys.argv[2:], in_flight=2)\n"
        "it = iter(loader)\n"
        "next(it)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(images), *CMD],
                              stdout=subprocess.PIPE, text=True)
    # Watchdog: a parent that never says "ready" is killed, and the readline below ends.
    watchdog = threading.Timer(PATIENCE, parent.kill)
    watchdog.start()
    try:
        assert parent.stdout.readline().strip() == "ready"
        watchdog.cancel()
        # The farm and its two producers, below the Python process.
        pids = _descendants(parent.pid, needle="tensorport")
        assert len(_descendants(parent.pid, needle="\x00produce\x00")) == 2, pids
    finally:
        parent.kill()
        parent.wait(timeout=PATIENCE)

    assert eventually(lambda: all(_gone(p) for p in pids)), "a process outlived its parent"


def test_ctrl_c_stops_the_loader_cleanly_and_leaves_no_producer_behind(tmp_path):
    """Ctrl-C at a terminal: SIGINT to the whole foreground process group (the Python process,
    its farm and the producers). The loop gets `KeyboardInterrupt`, the process goes on and ends
    normally, and no process of the farm outlives the iteration."""
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "8")
    script = (
        "import sys, tensorport\n"
        "files = sorted(__import__('pathlib').Path(sys.argv[1]).iterdir()) * 2000\n"
        "loader = tensorport.Loader(files, batch_size=4, producers=2, image_size=16,\n"
        "                           binary=sys.argv[2:], in_flight=2)\n"
        "try:\n"
        "    for n, _ in enumerate(loader):\n"
        "        if n == 0:\n"
        "            print('ready', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "print('after', loader.producer_pids, flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(images), *CMD],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    # Watchdog: a child that never says "ready" is killed, and the readline below ends.
    watchdog = threading.Timer(PATIENCE, lambda: os.killpg(child.pid, signal.SIGKILL))
    watchdog.start()
    try:
        assert child.stdout.readline().strip() == "ready"
        watchdog.cancel()
        pids = _descendants(child.pid, needle="tensorport")
        assert len(_descendants(child.pid, needle="\x00produce\x00")) == 2, pids
        os.killpg(child.pid, signal.SIGINT)
        out, _ = child.communicate(timeout=PATIENCE)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 0, out
    assert out.splitlines()[:2] == ["interrupted", "after []"], out

    assert eventually(lambda: all(_gone(p) for p in pids)), "a process outlived the iteration"


def _python(script, *args, env=None):
    """Runs `script` in a new Python process with a watchdog; returns (returncode, stdout)."""
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       timeout=PATIENCE * 2, env=env)
    return p.returncode, p.stdout + p.stderr


# A child script's files and Loader arguments: `sys.argv[1]` a folder of images (each listed 4
# times), `sys.argv[2:]` the command line that runs tensorport.
_LOADER_ARGS = (
    "files = sorted(__import__('pathlib').Path(sys.argv[1]).iterdir()) * 4\n"
    "kw = dict(batch_size=4, producers=2, image_size=16, binary=sys.argv[2:], timeout=60)\n"
)


def test_an_epoch_ends_before_its_server_and_the_process_exit_finishes_it(tmp_path):
    """The last batch ends the epoch: its server ends (and its folder goes) on a thread of its
    own, which the next epoch waits for, and which a process exiting right after the epoch
    still finishes: no folder of its loaders is left behind."""
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "8")
    script = (
        "import os, sys, tempfile, tensorport\n" + _LOADER_ARGS +
        "mine = lambda: [n for n in os.listdir(tempfile.gettempdir())\n"
        "                if n.startswith(f'tensorport-loader-{os.getpid()}-')]\n"
        "loader = tensorport.Loader(files, **kw)\n"
        "print('pid', os.getpid(), flush=True)\n"
        "n = sum(len(x) for x, _ in loader)\n"
        "first = loader._ending\n"
        "print('epoch', n, first is not None and first.name == 'tensorport-loader-end', flush=True)\n"
        "n = sum(len(x) for x, _ in loader)\n"
        "print('again', n, not first.is_alive(), len(mine()) <= 1, flush=True)\n"
    )
    rc, out = _python(script, str(images), *CMD)
    assert rc == 0, out
    assert "epoch 32 True" in out and "again 32 True True" in out, out
    pid = out.split("pid ", 1)[1].split()[0]
    left = [n for n in os.listdir(tempfile.gettempdir())
            if n.startswith(f"tensorport-loader-{pid}-")]
    assert left == [], f"the exited process left {left}"


def test_an_epoch_started_in_a_thread_that_ends_goes_on_uninterrupted(tmp_path):
    """The farm must not take the end of the thread that started it for its parent's death:
    an epoch begun in a short-lived thread, and a persistent loader's farm started in one, run
    to their end in the main thread."""
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "8")
    script = (
        "import sys, threading, time, tensorport\n" + _LOADER_ARGS +
        "it = iter(tensorport.Loader(files, **kw))\n"
        "first = []\n"
        "t = threading.Thread(target=lambda: first.append(next(it)))\n"
        "t.start(); t.join(); time.sleep(0.5)\n"
        "print('once', len(first) + sum(1 for _ in it), flush=True)\n"
        "kept = tensorport.Loader(files, persistent=True, **kw)\n"
        "t = threading.Thread(target=lambda: sum(1 for _ in kept))\n"
        "t.start(); t.join(); time.sleep(0.5)\n"
        "pids = list(kept.producer_pids)\n"
        "print('kept', sum(1 for _ in kept), pids == kept.producer_pids, flush=True)\n"
        "kept.close()\n"
    )
    rc, out = _python(script, str(images), *CMD)
    assert rc == 0, out
    assert "once 8" in out and "kept 8 True" in out, out


def test_a_daemon_thread_in_recv_batch_lets_the_process_exit_cleanly(tmp_path):
    """The pattern docs/python.md shows: a daemon thread serving in a loop. At interpreter
    exit it must not abort the process (a forced unwind through the native frames)."""
    d = tempfile.mkdtemp(dir="/tmp", prefix="tp")
    script = (
        "import sys, threading, time, tensorport\n"
        "srv = tensorport.Server(sys.argv[1])\n"
        "def serve():\n"
        "    while True:\n"
        "        srv.recv_batch(16, timeout=0.01)\n"
        "threading.Thread(target=serve, daemon=True).start()\n"
        "time.sleep(0.3)\n"
        "print('exiting', flush=True)\n"
    )
    try:
        for k in range(5):
            rc, out = _python(script, os.path.join(d, f"s{k}.sock"))
            assert rc == 0 and "exiting" in out, (k, rc, out)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_killed_loader_leaves_no_file_list_and_its_folder_is_swept(tmp_path):
    """The file list travels on the farm's standard input, never on disk; the socket folder of
    a loader whose process was killed is removed by the next loader's epoch."""
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "8")
    tmp = tempfile.mkdtemp(dir="/tmp", prefix="tp")
    env = dict(os.environ, TMPDIR=tmp)
    script = (
        "import sys, time, tensorport\n"
        "files = sorted(__import__('pathlib').Path(sys.argv[1]).iterdir()) * 500\n"
        "loader = tensorport.Loader(files, batch_size=4, producers=2, image_size=16,\n"
        "                           binary=sys.argv[2:], in_flight=2)\n"
        "it = iter(loader)\n"
        "next(it)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    try:
        parent = subprocess.Popen([sys.executable, "-c", script, str(images), *CMD],
                                  stdout=subprocess.PIPE, text=True, env=env)
        watchdog = threading.Timer(PATIENCE, parent.kill)
        watchdog.start()
        try:
            assert parent.stdout.readline().strip() == "ready"
            watchdog.cancel()
            folders = [f for f in os.listdir(tmp) if f.startswith(f"tensorport-loader-{parent.pid}-")]
            assert len(folders) == 1, os.listdir(tmp)
            assert os.listdir(os.path.join(tmp, folders[0])) == ["tp.sock"]
        finally:
            parent.kill()
            parent.wait(timeout=PATIENCE)
        rc, out = _python(
            "import sys, tensorport\n"
            "files = sorted(__import__('pathlib').Path(sys.argv[1]).iterdir())\n"
            "loader = tensorport.Loader(files, batch_size=4, producers=1, image_size=16,\n"
            "                           binary=sys.argv[2:], timeout=60)\n"
            "print('batches', sum(1 for _ in loader), flush=True)\n",
            str(images), *CMD, env=env)
        assert rc == 0 and "batches 2" in out, out
        assert os.listdir(tmp) == [], os.listdir(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_every_public_name_has_a_docstring():
    """`help(tensorport.X)` says something for every public class, function, method and
    property."""
    import inspect

    missing = []
    for name in dir(tensorport):
        obj = getattr(tensorport, name)
        if name.startswith("_") or inspect.ismodule(obj) or name == "annotations":
            continue
        if not getattr(obj, "__doc__", None):
            missing.append(name)
        if inspect.isclass(obj) and obj.__module__.startswith("tensorport"):
            missing += [f"{name}.{m}" for m, v in vars(obj).items()
                        if not m.startswith("_") and not getattr(v, "__doc__", None)]
    assert not missing, missing


def test_the_package_and_its_examples_type_check(tmp_path):
    """The extension's stubs (`_native.pyi`) and the package's annotations hold for the examples:
    mypy finds no error."""
    api = pytest.importorskip("mypy.api", reason="mypy is not installed here")
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                            "python")
    files = sorted(os.path.join(examples, f) for f in os.listdir(examples) if f.endswith(".py"))
    for what in (["-p", "tensorport"], files):
        out, err, code = api.run(["--ignore-missing-imports", "--cache-dir", str(tmp_path), *what])
        assert code == 0, out + err


def test_persistent_loader_keeps_its_producers_across_epochs(tmp_path):
    images = tmp_path / "images"
    run("images", "--out", str(images), "--count", "20")
    files = sorted(images.iterdir())
    loader = tensorport.Loader(files, batch_size=6, producers=2, image_size=16, binary=CMD,
                               shuffle=True, seed=3, timeout=PATIENCE, persistent=True)
    farms = []
    for epoch in range(3):
        seen = [i for _, idx in loader for i in idx.tolist()]
        assert sorted(seen) == list(range(20)), epoch
        farms.append(list(loader.producer_pids))
    # One farm (and so the same producers) served every epoch, and is still up between them.
    assert farms[0] == farms[1] == farms[2] and len(farms[0]) == 1
    farm = farms[0][0]
    assert os.path.exists(f"/proc/{farm}")
    # An epoch left early: the next still gets every file once (the earlier epoch's stragglers
    # are not taken for this one's).
    for _ in loader:
        break
    seen = [i for _, idx in loader for i in idx.tolist()]
    assert sorted(seen) == list(range(20))
    assert loader.producer_pids == [farm]
    loader.close()
    assert loader.producer_pids == []
    assert eventually(lambda: not os.path.exists(f"/proc/{farm}")), "the farm outlived close()"
    # Collected without close(): its farm ends too.
    again = tensorport.Loader(files, batch_size=6, producers=1, image_size=16, binary=CMD,
                              timeout=PATIENCE, persistent=True)
    assert sorted(i for _, idx in again for i in idx.tolist()) == list(range(20))
    farm = again.producer_pids[0]
    del again
    import gc

    gc.collect()
    assert eventually(lambda: not os.path.exists(f"/proc/{farm}")), "the farm outlived its loader"


# CUDA 13's control daemon listens on a Unix socket named `control` in its pipe folder (older
# ones made a FIFO there, which crates/tensorport-farm/tests/mps.rs's stand-in makes).
_MPS_CONTROL = r'''#!/bin/bash
pipe="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
if [ "$1" = "-d" ]; then
    PYTHON -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$pipe/control" || exit 1
    setsid bash -c 'while [ -S "$0/control" ]; do sleep 0.05; done' "$pipe" </dev/null >/dev/null 2>&1 &
    exit 0
fi
[ -S "$pipe/control" ] || exit 1
read -r cmd
case "$cmd" in
    quit) rm -f "$pipe/control"; exit 0 ;;
    get_server_list) exit 0 ;;
    *) exit 1 ;;
esac
'''


def test_mps_for_a_process_and_its_loader_with_a_stand_in_daemon(tmp_path, monkeypatch):
    """`_native.Mps` decides as the farm does, with a stand-in for nvidia-cuda-mps-control
    (a daemon that detaches and answers on a control socket, as CUDA 13's does): a private daemon
    where none runs, with the variables a CUDA process needs to join it, quit on close; none
    with mps='off'; without the control program, 'auto' goes without and says why, 'on'
    raises. A Loader refuses a mode it does not know."""
    import stat

    path = os.environ["PATH"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(_MPS_CONTROL.replace("PYTHON", shlex.quote(sys.executable)))
    control.chmod(control.stat().st_mode | stat.S_IEXEC)
    # No system daemon: its pipe folder holds no control pipe.
    (tmp_path / "system").mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "system"))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    m = tensorport._native.Mps("auto", [0])
    env = m.env
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert stat.S_ISSOCK(os.stat(os.path.join(pipe, "control")).st_mode)
    assert "CUDA_MPS_LOG_DIRECTORY" in env and m.why_off is None
    assert "private MPS daemon" in m.describe()
    m.close()
    assert not os.path.exists(pipe)
    assert tensorport._native.Mps("off", [0]).env == {}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    m = tensorport._native.Mps("auto", [0])
    assert m.env == {} and "nvidia-cuda-mps-control" in m.why_off
    with pytest.raises(RuntimeError, match="MPS cannot be had"):
        tensorport._native.Mps("on", [0])
    with pytest.raises(ValueError, match="mps='sometimes'"):
        tensorport.Loader(["a.jpg"], mps="sometimes")
    # A Loader with GPU producers has this process join MPS as it is made (before the caller's
    # model can start CUDA here), not at its first batch.
    monkeypatch.setenv("PATH", f"{bin_dir}:{path}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    monkeypatch.setattr(tensorport._loader, "_MPS", {})
    tensorport.Loader(["a.jpg"], device="cuda", producers=0, gpu_producers=1, mps="on")
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    try:
        assert stat.S_ISSOCK(os.stat(os.path.join(pipe, "control")).st_mode)
    finally:
        tensorport._loader._MPS[0].close()
        monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
        monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    assert not os.path.exists(pipe)
