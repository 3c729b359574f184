"""Checked downloads against a local HTTP server, and load_dataset(download=True) end to end."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import pickle
import tarfile
import threading
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import fedflat.data.sources as sources
from fedflat.data import ChecksumError, DownloadError, download_file, file_checksum, load_dataset, verify_file
from fedflat.data.sources import RemoteFile

IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        type(self).requests.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """Serve ``tmp_path/www`` on 127.0.0.1 (random port); yields (base_url, folder, requested paths)."""
    folder = tmp_path / "www"
    folder.mkdir()
    handler = type("Handler", (_QuietHandler,), {"requests": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", folder, handler.requests
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDFLAT_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def serve_mnist(folder: Path, base_url: str, seed: int = 0) -> tuple[tuple[RemoteFile, ...], np.ndarray, np.ndarray]:
    """Write a tiny gzipped MNIST into the served folder; returns its RemoteFiles and the labels."""
    rng = np.random.default_rng(seed)
    y_train, y_test = rng.integers(0, 10, 20), rng.integers(0, 10, 8)
    arrays = (rng.integers(0, 256, (20, 28, 28)), y_train, rng.integers(0, 256, (8, 28, 28)), y_test)
    remotes = []
    for stem, array in zip(IDX_STEMS, arrays):
        data = idx_bytes(array)
        (folder / f"{stem}.gz").write_bytes(data)
        remotes.append(RemoteFile(f"{base_url}{stem}.gz", f"{stem}.gz", sha256(data)))
    return tuple(remotes), y_train, y_test


# ----------------------------------------------------------------------------- download_file

def test_download_writes_the_file(server, tmp_path):
    url, folder, _ = server
    payload = np.random.default_rng(0).bytes(300_000)
    (folder / "blob.bin").write_bytes(payload)
    dest = tmp_path / "out" / "sub" / "blob.bin"
    assert download_file(url + "blob.bin", dest, sha256(payload)) == dest
    assert dest.read_bytes() == payload
    assert [p.name for p in dest.parent.iterdir()] == ["blob.bin"]  # no temp file left


def test_download_with_md5(server, tmp_path):
    url, folder, _ = server
    (folder / "a.txt").write_bytes(b"hello")
    dest = download_file(url + "a.txt", tmp_path / "a.txt", hashlib.md5(b"hello").hexdigest().upper(), "md5")
    assert dest.read_bytes() == b"hello"


def test_checksum_mismatch_leaves_nothing(server, tmp_path):
    url, folder, _ = server
    (folder / "a.txt").write_bytes(b"tampered")
    out = tmp_path / "out"
    expected = sha256(b"original")
    with pytest.raises(ChecksumError) as info:
        download_file(url + "a.txt", out / "a.txt", expected)
    message = str(info.value)
    assert expected in message and sha256(b"tampered") in message and "expected" in message
    assert not out.exists()  # not even the folder the download made for its file


def test_http_error_leaves_nothing(server, tmp_path):
    url, _, _ = server
    with pytest.raises(DownloadError, match="could not download .*missing.bin .*File not found"):
        download_file(url + "missing.bin", tmp_path / "missing.bin", sha256(b""))
    assert list(tmp_path.iterdir()) == [tmp_path / "www"]


def test_no_network_is_one_clear_error_and_leaves_no_empty_folder(tmp_path):
    """Port 9 of 127.0.0.1 refuses the connection, as a machine without network does: the error says what
    to do, and the folders the download made for its file are gone again."""
    dest = tmp_path / "cache" / "fedflat" / "data" / "cifar10" / "x.tar.gz"
    with pytest.raises(DownloadError, match="without network access, copy x.tar.gz from elsewhere"):
        download_file("http://127.0.0.1:9/x.tar.gz", dest, sha256(b""), timeout=5)
    assert list(tmp_path.iterdir()) == []


def test_unknown_algorithm(tmp_path):
    with pytest.raises(ValueError, match="unknown checksum algorithm 'crc99'"):
        download_file("http://127.0.0.1:9/x", tmp_path / "x", "00", algorithm="crc99")


def test_verify_file(tmp_path):
    path = tmp_path / "f"
    assert not verify_file(path, sha256(b"abc"))
    path.write_bytes(b"abc")
    assert verify_file(path, sha256(b"abc")) and verify_file(path, sha256(b"abc").upper())
    assert not verify_file(path, sha256(b"abd"))
    assert verify_file(path, hashlib.md5(b"abc").hexdigest(), "md5")
    assert file_checksum(path, "md5") == hashlib.md5(b"abc").hexdigest()


def test_official_checksums_are_well_formed():
    for name, remotes in sources.REMOTE.items():
        for remote in remotes:
            assert remote.algorithm == "sha256" and len(remote.checksum) == 64, name
            int(remote.checksum, 16)
            assert remote.url.endswith("/" + remote.filename)


# ----------------------------------------------------------------------------- load_dataset(download=True)

def test_mnist_download_end_to_end(server, tmp_path, monkeypatch):
    url, folder, requests = server
    remotes, y_train, y_test = serve_mnist(folder, url)
    monkeypatch.setitem(sources.REMOTE, "mnist", remotes)
    root = tmp_path / "root"
    data = load_dataset("mnist", root=str(root), download=True)
    assert data.x_train.shape == (20, 1, 28, 28) and data.x_test.shape == (8, 1, 28, 28)
    np.testing.assert_array_equal(data.y_train.numpy(), y_train)
    np.testing.assert_array_equal(data.y_test.numpy(), y_test)
    assert sorted(p.name for p in (root / "mnist").iterdir()) == sorted(r.filename for r in remotes)
    assert len(requests) == 4
    # found on disk the next time: no download, even when allowed
    again = load_dataset("mnist", root=root, download=True)
    assert len(requests) == 4 and np.array_equal(again.y_test.numpy(), y_test)


def test_download_goes_to_env_then_cache(server, tmp_path, monkeypatch):
    url, folder, _ = server
    remotes, _, _ = serve_mnist(folder, url, seed=1)
    monkeypatch.setitem(sources.REMOTE, "mnist", remotes)
    monkeypatch.setenv("FEDFLAT_DATA", str(tmp_path / "env"))
    load_dataset("mnist", download=True)
    assert (tmp_path / "env" / "mnist" / "t10k-labels-idx1-ubyte.gz").is_file()
    monkeypatch.delenv("FEDFLAT_DATA")
    monkeypatch.setitem(sources.REMOTE, "fmnist", remotes)
    monkeypatch.setitem(sources.SYSTEM_DIRS, "fmnist", ())
    load_dataset("fmnist", download=True)
    assert (tmp_path / "xdg-cache" / "fedflat" / "data" / "fashion-mnist" / "train-images-idx3-ubyte.gz").is_file()


def test_download_skips_a_root_that_cannot_be_written(server, tmp_path, monkeypatch):
    url, folder, _ = server
    remotes, _, _ = serve_mnist(folder, url, seed=2)
    monkeypatch.setitem(sources.REMOTE, "mnist", remotes)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    load_dataset("mnist", root=blocker / "root", download=True)  # mkdir under a file fails
    assert (tmp_path / "xdg-cache" / "fedflat" / "data" / "mnist" / "train-labels-idx1-ubyte.gz").is_file()


def test_download_with_bad_checksum_fails_cleanly(server, tmp_path, monkeypatch):
    url, folder, _ = server
    remotes, _, _ = serve_mnist(folder, url)
    broken = (replace(remotes[0], checksum="0" * 64),) + remotes[1:]
    monkeypatch.setitem(sources.REMOTE, "mnist", broken)
    with pytest.raises(ChecksumError, match="0" * 64):
        load_dataset("mnist", root=tmp_path / "root", download=True)
    assert not (tmp_path / "root").exists()  # nothing half-cached, not even an empty folder


def test_cifar10_download_end_to_end(server, tmp_path, monkeypatch):
    url, folder, _ = server
    rng = np.random.default_rng(0)
    labels = {}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            labels[member] = rng.integers(0, 10, 3)
            batch = {b"data": rng.integers(0, 256, (3, 3072), dtype=np.uint8), b"labels": labels[member].tolist()}
            data = pickle.dumps(batch, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{member}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (folder / "cifar-10-python.tar.gz").write_bytes(buffer.getvalue())
    monkeypatch.setitem(sources.REMOTE, "cifar10", (RemoteFile(url + "cifar-10-python.tar.gz",
                                                               "cifar-10-python.tar.gz", sha256(buffer.getvalue())),))
    data = load_dataset("cifar10", root=tmp_path / "root", download=True)
    assert data.x_train.shape == (15, 3, 32, 32) and data.augmentation == "cifar"
    np.testing.assert_array_equal(data.y_test.numpy(), labels["test_batch"])
    assert (tmp_path / "root" / "cifar10" / "cifar-10-batches-py" / "test_batch").is_file()
