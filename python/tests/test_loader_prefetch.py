"""The Loader's batches made ahead on a thread of its own (`prefetch`): the same batches as when
each is gathered on request, errors raised in the caller, and a loop left early ends the thread
and the farm before anything else reads the server."""

import subprocess
import threading
import time

import numpy as np
import pytest

import tensorport
from tensorport import TensorportError

CMD = tensorport.command()
PATIENCE = 60.0


def images(tmp_path, count):
    out = tmp_path / "images"
    subprocess.run([*CMD, "--log", "warn", "images", "--out", str(out), "--count", str(count)],
                   check=True, capture_output=True)
    return sorted(out.iterdir())


def rows_by_index(loader):
    got = {}
    for x, idx in loader:
        for row, i in zip(x, idx.tolist()):
            assert i not in got
            got[i] = np.array(row)
    return got


def loader_threads():
    return [t for t in threading.enumerate() if t.name == "tensorport-loader" and t.is_alive()]


def test_prefetched_batches_equal_those_gathered_when_asked(tmp_path):
    files = images(tmp_path, 30)
    kw = dict(batch_size=4, producers=2, image_size=16, binary=CMD, timeout=PATIENCE)
    asked = rows_by_index(tensorport.Loader(files, prefetch=0, **kw))
    for prefetch in (1, 2, 6):
        ahead = rows_by_index(tensorport.Loader(files, prefetch=prefetch, **kw))
        assert sorted(ahead) == list(range(30)), prefetch
        assert all(np.array_equal(ahead[i], asked[i]) for i in asked), prefetch
    assert not loader_threads()
    with pytest.raises(ValueError, match="prefetch"):
        tensorport.Loader(files, prefetch=-1, binary=CMD)


def test_a_loop_that_holds_a_batch_finds_the_next_ones_made(tmp_path):
    """While the caller holds batch 1, the loader's thread makes batches 2 and 3 (and starts
    on 4): the model's time and the gathering overlap."""
    files = images(tmp_path, 24)
    loader = tensorport.Loader(files, batch_size=4, producers=2, image_size=16, binary=CMD,
                               timeout=PATIENCE, prefetch=2)
    it = iter(loader)
    first = next(it)
    deadline = time.monotonic() + PATIENCE
    while loader._made < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader._made >= 3, loader._made
    seen = first[1].tolist() + [i for _, idx in it for i in idx.tolist()]
    assert sorted(seen) == list(range(24))


def test_an_error_on_the_loaders_thread_is_raised_in_the_loop(tmp_path):
    files = images(tmp_path, 8)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not a jpeg")
    loader = tensorport.Loader([*files, bad], batch_size=4, producers=2, image_size=16,
                               binary=CMD, timeout=PATIENCE)
    with pytest.raises(TensorportError, match="broken.jpg"):
        for _ in loader:
            pass
    assert not loader_threads()


def test_leaving_a_prefetching_loop_early_ends_its_thread_and_farm(tmp_path):
    """`break` after one batch: the thread and the farm end; a persistent loader's next epoch
    gets every file once (no batch of the abandoned one is read into it)."""
    files = images(tmp_path, 40)
    once = tensorport.Loader(files, batch_size=4, producers=2, image_size=16, binary=CMD,
                             timeout=PATIENCE, prefetch=3)
    it = iter(once)
    next(it)
    farm_pid = once.producer_pids[0]
    it.close()
    assert not loader_threads()
    assert subprocess.run(["kill", "-0", str(farm_pid)], capture_output=True).returncode != 0

    kept = tensorport.Loader(files, batch_size=4, producers=2, image_size=16, binary=CMD,
                             timeout=PATIENCE, prefetch=3, persistent=True)
    try:
        for _ in kept:
            break
        assert not loader_threads()
        seen = [i for _, idx in kept for i in idx.tolist()]
        assert sorted(seen) == list(range(40))
    finally:
        kept.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_file_handed_over_twice_in_one_fill_is_kept_once(tmp_path, monkeypatch, prefetch):
    """At the end of the queue the farm gives an idle producer a second copy of a file another
    still holds, and both copies can arrive in one fill of the batch: the file is kept once."""
    files = images(tmp_path, 12)
    real = tensorport.Loader._fill
    doubled = []

    def fill(self, server, imgs, start, want):
        if want < 2 or doubled:
            return real(self, server, imgs, start, want)
        got = real(self, server, imgs, start, want - 1)
        if got:
            rid, row = got[0]
            imgs[start + len(got)] = imgs[row]
            got.append((rid, start + len(got)))
            doubled.append(rid)
        return got

    monkeypatch.setattr(tensorport.Loader, "_fill", fill)
    loader = tensorport.Loader(files, batch_size=4, producers=2, image_size=16, binary=CMD,
                               timeout=PATIENCE, prefetch=prefetch)
    seen = rows_by_index(loader)
    assert doubled
    assert sorted(seen) == list(range(12))
