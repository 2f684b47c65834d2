"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

import pytest
import torch

from dsa_train.optim import native
from dsa_train.train import loop


def assert_same_params(reference: torch.nn.Module, ours: torch.nn.Module, step: int) -> None:
    """Bit-for-bit equality: both optimizers must do the same float operations."""
    for (name, a), (_, b) in zip(reference.named_parameters(), ours.named_parameters()):
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(f"{name} differs after step {step}: max |diff| = {diff:.3e}")


@contextlib.contextmanager
def error_at_step(step: int):
    """Inside the block, training raises ``RuntimeError("injected error at step N")`` as it is
    about to take step ``step``: the run stops with an error that unwinds (its handlers and
    ``finally`` blocks run), and a resume starts from the last checkpoint. It is not a crash:
    the SIGKILL tests (``test_torture.py``, ``test_residency.py``, ``test_checkpoint_deltas.py``)
    are. The step it wraps, the one in place on entry, is back after."""
    real_step = loop.Training.step

    def fail(self, picked):
        if self.step_count == step:
            raise RuntimeError(f"injected error at step {step}")
        return real_step(self, picked)

    with mock.patch.object(loop.Training, "step", fail):
        yield


def assert_same_tensors(a: dict, b: dict, what: str = "") -> None:
    """Two state dicts hold the same keys, at least one tensor, and equal tensors under each
    key (``all(torch.equal(a[k], b[k]) for k in a)`` alone passes when the keys differ or a
    holds none)."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}"
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert tensors, f"{what}: no tensors to compare in {sorted(a)}"
    for k in tensors:
        assert isinstance(b[k], torch.Tensor) and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def in_ci() -> bool:
    """Whether this is CI (``CI=true``, as .ci/run and hosted CI set it): there, what the suite
    needs and .ci/run installs (a C compiler, setuptools) is a failure when missing, never a skip."""
    return os.environ.get("CI", "").lower() == "true"


def skip_unless_ci(reason: str) -> None:
    """Skip with ``reason`` on a developer's machine; fail with it in CI."""
    if in_ci():
        pytest.fail(f"CI=true: {reason}")
    pytest.skip(reason)


def require_compiler(what: str) -> str:
    """The C compiler (``$CC``, else ``cc``): a skip saying ``what`` needs it where there is none,
    a failure in CI, whose .ci/run checks that one is there."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        skip_unless_ci(f"no C compiler ({compiler}) on this machine: {what}")
    return compiler


def fused_kernel() -> native.RowKernel:
    """The compiled kernel. Skips only where it cannot be had: no C compiler (``$CC``, else
    ``cc``) on this machine (a failure in CI), or ``DSA_NATIVE=0``. Where a compiler is there,
    a kernel that does not build, or fails its self-test, fails the test: broken C source must
    not pass as a skip."""
    loaded = native.load()
    if loaded is not None:
        return loaded
    if os.environ.get("DSA_NATIVE", "1") == "0":
        pytest.skip("DSA_NATIVE=0 turns the fused kernel off")
    compiler = require_compiler("install gcc or clang to build and test the fused kernel")
    try:
        native.build()
    except Exception as e:
        pytest.fail(f"the C compiler {compiler!r} is there but the fused kernel does not build: {e}")
    pytest.fail("the fused kernel builds but fails its self-test against the torch path (or does not load)")


def file_system_of(path) -> str:
    """The type of the file system holding ``path`` ("ext4", "tmpfs", ...), from /proc/self/mountinfo."""
    target, best, kind = os.path.realpath(path), "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            mount_point = fields.split()[4].replace("\\040", " ")
            inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, kind = mount_point, rest.split()[0]
    return kind


@contextlib.contextmanager
def small_tmpfs(folder, size: str = "4m"):
    """A tmpfs of ``size`` mounted at ``folder`` (made here) for the block: a real file system
    that fills up. Needs root (CI runs as root); skips with the reason where mounting is
    impossible. Unmounted after, whatever happened."""
    import subprocess

    os.makedirs(folder, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root: a real full disk cannot be made here")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): a real full disk cannot be made")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder, leave: int = 0) -> None:
    """Fill ``folder``'s file system with a file ``filler`` until at most ``leave`` bytes are free."""
    stat = os.statvfs(folder)
    room = stat.f_bavail * stat.f_frsize - leave
    with open(os.path.join(folder, "filler"), "wb") as f:
        try:
            while room > 0:
                room -= f.write(b"\0" * min(room, 1 << 20))
                f.flush()
        except OSError:
            pass


def pagemap_hidden() -> str | None:
    """Why this process cannot read ``/proc/self/pagemap`` (the state is then mapped shared), or
    ``None`` where it can. Read here with plain file IO, independently of the product's
    ``pagemap_readable``: a regression there fails the memory-budget tests instead of skipping them."""
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            first = f.read(8)
    except OSError as e:
        return f"this kernel hides /proc/self/pagemap ({e.strerror}): row files are mapped shared"
    if len(first) != 8:
        return f"/proc/self/pagemap gave {len(first)} bytes, not an 8-byte entry: row files are mapped shared"
    return None


NODE_RECIPE = """\
name: {name}
description: "{description}"
dataset: {dataset}
model:
  kind: {model}
  dim: 16
  embedding_storage: {storage}
  node2vec: {{walk_length: 6, context_size: 3, walks_per_node: 2}}
  sage: {{task: {task}, layers: 2, hidden: 16, fanout: [4, 3]}}
train: {train}
optimizer: {{kind: {optimizer}, lr: 0.05, dense_lr: 0.01}}
eval: {eval}
"""


def node_recipe(
    name: str,
    dataset: str,
    *,
    train: str,
    eval: str,
    model: str = "node2vec",
    task: str = "link",
    optimizer: str = "dsa",
    storage: str = "memory",
    description: str = "",
) -> str:
    """A small node-embedding recipe's YAML (node2vec or GraphSAGE, 16 wide): ``dataset``,
    ``train`` and ``eval`` are its sections as YAML flow mappings."""
    fields = dict(
        name=name,
        description=description,
        dataset=dataset,
        model=model,
        task=task,
        optimizer=optimizer,
        storage=storage,
    )
    return NODE_RECIPE.format(**fields, train=train, eval=eval)


class FileServer:
    """A threaded HTTP server on 127.0.0.1 (a free port) serving bytes from memory by path
    (``/<host>/<path>``, as ``dsa_train.data.downloads.address`` asks for them under
    ``$DSA_DOWNLOAD_MIRROR``); records each request's path and Range header and answers a
    Range with 206 (416 past the end). ``honour_range=False`` answers every request whole;
    ``cut_after=n`` sends the next answer's first ``n`` bytes only, as a dropped connection does."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.honour_range = True
        self.cut_after: int | None = None  # send this many bytes of the next body, then drop the connection
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                server.requests.append((self.path, self.headers.get("Range")))
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                asked = self.headers.get("Range")
                if asked and server.honour_range:
                    start = int(asked.removeprefix("bytes=").split("-")[0])
                    if start >= len(body):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                    body = body[start:]
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if server.cut_after is not None:
                    body, server.cut_after = body[: server.cut_after], None
                    self.close_connection = True
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def serve(self, url: str, body: bytes) -> None:
        from dsa_train.data.downloads import address

        self.files[address(url).removeprefix(self.base)] = body

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
