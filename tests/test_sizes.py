"""Sizes that cannot fit are refused before anything is allocated, with the bytes needed and
the bytes available; running out of memory anyway ends with one ``Error:`` line."""

from __future__ import annotations

import re
import resource
import time
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from dsa_train import memory
from dsa_train.cli._errors import handle_errors
from dsa_train.cli.app import app
from dsa_train.errors import DsaError

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
KARATE = Path(__file__).resolve().parents[1] / "recipes" / "karate-node2vec.yaml"
SIZE = re.compile(r"\d \w?iB \(\d{1,3}(,\d{3})* bytes\)")  # "42.5 GiB (45,586,849,792 bytes)"


@pytest.fixture
def bounded_address_space():
    """Cap this process's address space at its current size + 8 GiB while the test runs, so a
    size that slipped past the checks fails to allocate at once instead of eating the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = memory._status_bytes("VmSize:") + (8 << 30)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run(recipe, tmp_path, *overrides, env=None):
    args = ["run", str(recipe), "-o", str(tmp_path / "run")]
    for override in overrides:
        args += ["--set", override]
    started = time.perf_counter()
    result = CliRunner(env=env).invoke(app, args)
    return result, time.perf_counter() - started


def assert_refused(result, elapsed, key):
    output = result.stdout + result.stderr
    assert result.exit_code == 1, output
    error = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1, output
    assert key in error[0], output
    assert len(SIZE.findall(error[0])) >= 2, output  # the bytes needed and the bytes available
    assert "available" in error[0] or "free" in error[0], output
    assert "ran out of memory" not in output, "refused by the check, not by the allocator"
    assert "Traceback" not in output
    assert "Hint:" in result.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s: it was refused late"


@pytest.mark.parametrize(
    "overrides,key",
    [
        (("model.dim=1000000000000",), "model.dim=1000000000000"),
        (("train.negatives=100000000",), "train.negatives=100000000"),
        # the default slice keeps any batch's scores small: a slice as large as the batch does not
        (("train.batch_size=100000000", "train.query_chunk=100000000"), "train.batch_size=100000000"),
    ],
)
def test_absurd_sizes_are_refused_before_allocating(tmp_path, bounded_address_space, overrides, key):
    result, elapsed = run(QUICKSTART, tmp_path, *overrides)
    assert_refused(result, elapsed, key)
    assert "lower" in result.stderr


def test_huge_table_names_disk_storage_as_a_fix(tmp_path, bounded_address_space):
    result, elapsed = run(QUICKSTART, tmp_path, "model.dim=1000000000")
    assert_refused(result, elapsed, "model.dim=1000000000")
    assert "model.embedding_storage: disk" in result.stderr


def test_disk_table_larger_than_the_disk_is_refused_before_writing(tmp_path, bounded_address_space):
    result, elapsed = run(QUICKSTART, tmp_path, "model.dim=1000000000000", "model.embedding_storage=disk")
    assert_refused(result, elapsed, "model.dim=1000000000000")
    assert "of disk in" in result.stderr
    tables = tmp_path / "run" / "tables"
    assert not tables.exists() or not any(tables.iterdir()), "no table file, not even a partial one"


def test_node2vec_step_too_big_is_refused(tmp_path, bounded_address_space):
    result, elapsed = run(KARATE, tmp_path, "model.node2vec.walks_per_node=1000000000")
    assert_refused(result, elapsed, "model.node2vec.walks_per_node=1000000000")


def test_the_check_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_MEMORY_CHECK", "0")
    calls = []
    monkeypatch.setattr(memory, "host_available_bytes", lambda: calls.append(1) or 0)
    memory.require_memory("x", 10**30, key="model.dim=1", hint="lower it")
    assert not calls


# -- the check itself -------------------------------------------------------------------------


@pytest.fixture
def host_has(monkeypatch):
    def set_available(n):
        monkeypatch.setattr(memory, "host_available_bytes", lambda: n)

    monkeypatch.delenv("DSA_MEMORY_CHECK", raising=False)
    return set_available


def test_require_memory_refuses_what_does_not_fit(host_has):
    host_has(3 << 30)
    memory.require_memory("the table", 2 << 30, key="model.dim=64", hint="lower model.dim")  # fits
    with pytest.raises(DsaError) as refused:
        memory.require_memory("the table", 5 << 30, key="model.dim=64", hint="lower model.dim")
    message = refused.value.message
    assert message.startswith("model.dim=64: the table")
    assert "5.0 GiB (5,368,709,120 bytes)" in message and "3.0 GiB (3,221,225,472 bytes)" in message
    assert "lower model.dim" in refused.value.hint


def test_require_memory_counts_what_is_reserved_first(host_has):
    host_has(3 << 30)
    with pytest.raises(DsaError) as refused:
        memory.require_memory(
            "a step", 2 << 30, key="train.batch_size=9", hint="h", reserved=2 << 30, reserved_for="the tables"
        )
    assert "1.0 GiB (1,073,741,824 bytes) is available" in refused.value.message
    assert "2.0 GiB go to the tables" in refused.value.message


def test_require_memory_does_not_refuse_when_memory_is_unknown(host_has):
    host_has(None)
    memory.require_memory("the table", 10**30, key="model.dim=64", hint="h")


def test_cuda_memory_is_asked_of_the_device(monkeypatch, host_has):
    host_has(10**15)  # the host has room: only the device may refuse
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    with pytest.raises(DsaError, match=r"memory on cuda:0, but only 1\.0 GiB"):
        memory.require_memory("a step", 2 << 30, key="train.negatives=9", hint="h", device=torch.device("cuda:0"))
    memory.require_memory("a step", 2 << 30, key="train.negatives=9", hint="h", device=torch.device("cpu"))


def test_require_disk_compares_with_free_space(monkeypatch, tmp_path):
    monkeypatch.delenv("DSA_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 1000)
    memory.require_disk("the table file", 999, tmp_path, key="model.dim=8", hint="h")
    with pytest.raises(
        DsaError,
        match=r"model\.dim=8: the table file would take 2\.0 KiB \(2,000 bytes\) of disk .* only 1,000 bytes is free",
    ):
        memory.require_disk("the table file", 2000, tmp_path, key="model.dim=8", hint="h")


def test_available_memory_comes_from_meminfo_and_ulimit():
    available = memory.host_available_bytes()
    assert available is None or available > 0
    assert memory.free_disk_bytes(Path("/nonexistent/deeper")) > 0  # the nearest existing parent's
    assert memory.human_bytes(512) == "512 bytes" and memory.human_bytes(3 << 40) == "3.0 TiB"


# -- the safety net in the CLI ----------------------------------------------------------------


def _app_raising(error: BaseException) -> typer.Typer:
    failing = typer.Typer()

    @failing.command()
    @handle_errors
    def go() -> None:
        raise error

    @failing.command()
    def other() -> None:  # a second command, so that `go` is a subcommand
        pass

    return failing


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 8000000000000000 bytes. Error code 12 (Cannot allocate memory)"
        ),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    ],
    ids=["MemoryError", "DefaultCPUAllocator", "torch.OutOfMemoryError"],
)
def test_running_out_of_memory_ends_with_one_error_line(monkeypatch, error):
    monkeypatch.delenv("DSA_DEBUG", raising=False)
    result = CliRunner().invoke(_app_raising(error), ["go"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith("Error: ran out of memory") and len(lines) == 2, result.stderr
    assert lines[1].startswith("Hint: lower train.batch_size, train.negatives or model.dim")
    assert "model.embedding_storage: disk" in lines[1]
    assert "Traceback" not in result.stdout + result.stderr


def test_out_of_memory_shows_the_traceback_with_dsa_debug(monkeypatch):
    monkeypatch.setenv("DSA_DEBUG", "1")
    result = CliRunner().invoke(_app_raising(MemoryError()), ["go"])
    assert isinstance(result.exception, MemoryError)


def test_other_runtime_errors_are_not_called_out_of_memory(monkeypatch):
    monkeypatch.delenv("DSA_DEBUG", raising=False)
    result = CliRunner().invoke(_app_raising(RuntimeError("shape mismatch")), ["go"])
    assert result.exit_code == 1
    assert "Error: RuntimeError: shape mismatch" in result.stderr and "out of memory" not in result.stderr


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 8000000000000000 bytes. Error code 12 (Cannot allocate memory)"
        ),
    ],
    ids=["MemoryError", "DefaultCPUAllocator"],
)
def test_running_out_of_memory_in_a_real_run_ends_with_one_error_line(tmp_path, monkeypatch, error):
    """The real ``dsa-train run`` (karate-node2vec), its third training step running out of
    memory: one ``Error:`` line and its ``Hint:``, exit status 1, no traceback."""
    from dsa_train.train import loop

    monkeypatch.delenv("DSA_DEBUG", raising=False)
    real_step = loop.Training.step

    def step(self, picked):
        if self.step_count == 2:
            raise error
        return real_step(self, picked)

    monkeypatch.setattr(loop.Training, "step", step)
    result, _ = run(KARATE, tmp_path, "train.epochs=3")
    output = result.stdout + result.stderr
    assert result.exit_code == 1, output
    lines = result.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("Error:")]
    assert len(errors) == 1 and lines[errors[0]].startswith("Error: ran out of memory"), output
    assert lines[errors[0] + 1 :] == [lines[-1]] and lines[-1].startswith("Hint: lower train.batch_size"), output
    assert "Traceback" not in output and 'File "' not in output, output
