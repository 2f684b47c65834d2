"""inspect-state against hostile input: huge or wrong --rows, truncated row files, and --check.

Every refusal is a clean ``Error:`` line with a hint and exit code 1, decided before anything
large is built or read; ``--check`` finds exactly the rows whose values Adam cannot have made.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import struct
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dsa_train import DiskEmbedding, DiskSparseAdam, StateError
from dsa_train.cli.app import app
from dsa_train.memory import PeakRssAnon, rss_anon_bytes
from dsa_train.storage import inspect as inspect_module
from dsa_train.storage.format import HEADER_BYTES, RowSpec
from dsa_train.storage.inspect import StateInspector

ROWS, DIM = 1000, 4
TOUCHED = [1, 2, 3, 500, 999]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def state(tmp_path):
    """A closed state directory: 1,000 x 4 rows, rows 1, 2, 3, 500 and 999 touched, 3 steps."""
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    path = tmp_path / "opt_state_cache"
    with DiskSparseAdam(emb.named_parameters(), lr=0.01, state_dir=path) as opt:
        for _ in range(3):
            opt.zero_grad()
            emb(torch.tensor(TOUCHED)).pow(2).sum().backward()
            opt.step()
    return path


@pytest.fixture
def table_state(tmp_path):
    """A disk embedding table (layout w|m|v) and its closed state directory."""
    disk = DiskEmbedding(ROWS, DIM, path=tmp_path / "t.table")
    with DiskSparseAdam(disk.named_parameters(), lr=0.01, state_dir=tmp_path / "state") as opt:
        disk(torch.tensor(TOUCHED)).sum().backward()
        opt.step()
    del disk, opt
    gc.collect()  # the table's mapping goes before its file is edited
    return tmp_path / "state", tmp_path / "t.table"


def poke(path, spec: RowSpec, row: int, slot: str, value: float, element: int = 0) -> None:
    """Write one float32 into a record, as a bit flip or a bad write would."""
    field = next(f for f in spec.fields if f.name == slot)
    with open(path, "r+b") as f:
        os.pwrite(
            f.fileno(), struct.pack("<f", value), HEADER_BYTES + row * spec.row_bytes + field.offset + 4 * element
        )


def weight_spec(layout="m|v") -> RowSpec:
    return RowSpec("weight", (ROWS, DIM), "float32", "", layout)


class memory_ceiling:
    """Let this process's data segment grow by at most ``limit`` bytes while the block runs,
    so code that tries to build something huge fails fast instead of swapping the machine."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self):
        self.old = resource.getrlimit(resource.RLIMIT_DATA)
        with open("/proc/self/status") as f:
            data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (data + self.limit, self.old[1]))
        return self

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_DATA, self.old)


# -- --rows ----------------------------------------------------------------------------------
def test_a_huge_rows_range_is_refused_at_once_in_bounded_memory(state):
    before = rss_anon_bytes()
    start = time.perf_counter()
    with memory_ceiling(512 << 20), PeakRssAnon() as peak:
        result = invoke("inspect-state", state, "--rows", "0:2000000000")
    seconds = time.perf_counter() - start
    assert result.exit_code == 1
    assert "Error: parameter 'weight' has 1,000 rows (0 to 999); rows [0:2000000000] are out of range" in result.stderr
    assert "Hint: ask for rows in 0:1000" in result.stderr
    assert seconds < 60 and peak.peak - before < 64 << 20, (
        seconds,
        peak.peak - before,
    )  # (walking 2e9 rows would take hours: a bound a busy machine meets)
    assert result.stdout == ""  # refused before anything was printed


def test_asking_for_more_rows_than_one_call_prints_is_refused(tmp_path):
    emb = torch.nn.Embedding(300_000, 2, sparse=True)
    path = tmp_path / "big"
    with DiskSparseAdam(emb.named_parameters(), state_dir=path) as opt:
        emb(torch.tensor([0, 299_999])).sum().backward()
        opt.step()
    with memory_ceiling(512 << 20):
        result = invoke("inspect-state", path, "--rows", "0:250000")
    assert result.exit_code == 1 and result.stdout == ""
    assert "Error: --rows asks for 250,000 rows; one call prints at most 100,000 rows of a parameter" in result.stderr
    result = invoke("inspect-state", path, "--rows", "299990:300000", "--json")  # within the cap: fine
    assert result.exit_code == 0, result.stderr
    assert list(json.loads(result.stdout)["params"]["weight"]["rows"]) == [str(r) for r in range(299_990, 300_000)]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("999:1001", "rows [999:1001] are out of range"),
        ("1000", "rows [1000] are out of range"),
        ("-1", "rows [-1] are out of range"),
        ("5,3:7,-4:2", "rows [-4:2] are out of range"),
        ("7:3", "--rows range 7:3 is empty"),
    ],
)
def test_rows_outside_the_parameter_are_refused_with_its_row_count(state, rows, message):
    result = invoke("inspect-state", state, f"--rows={rows}")
    assert result.exit_code == 1 and result.stdout == ""
    assert message in result.stderr
    if "out of range" in message:
        assert "parameter 'weight' has 1,000 rows" in result.stderr


def test_asked_rows_are_read_in_chunks_and_match_the_file(state, monkeypatch):
    reads = []
    real = os.pread
    monkeypatch.setattr(inspect_module.os, "pread", lambda fd, n, at: reads.append(n) or real(fd, n, at))
    inspector = StateInspector(state)
    chunks = list(inspector.iter_rows("weight", [(0, 1000), (998, 1000)]))
    assert max(reads) <= inspect_module.CHUNK_BYTES and len(chunks) >= 2
    raw = np.fromfile(state / "weight.rows", dtype=np.float32, offset=HEADER_BYTES).reshape(ROWS, 2, DIM)
    rows = [r for chunk, _, _ in chunks for r in chunk]
    assert rows == [*range(1000), 998, 999]
    m = np.concatenate([c[1] for c in chunks])
    v = np.concatenate([c[2] for c in chunks])
    np.testing.assert_array_equal(m, raw[rows, 0])
    np.testing.assert_array_equal(v, raw[rows, 1])


# -- truncated and resized row files ---------------------------------------------------------
@pytest.mark.parametrize("change", [-1, -32, -(ROWS * 32), +4096])
@pytest.mark.parametrize("args", [[], ["--rows", "0:3"], ["--check"], ["--stats", "--json"]])
def test_a_row_file_of_the_wrong_size_is_a_clean_error(state, change, args):
    path = state / "weight.rows"
    need = HEADER_BYTES + ROWS * 32
    os.truncate(path, need + change)
    result = invoke("inspect-state", state, *args)
    assert result.exit_code == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == (
        f"Error: row file '{path}' of parameter 'weight' is {need + change:,} bytes, but 1,000 rows of 32 bytes "
        f"(shape [1000, 4], layout 'm|v') need {need:,} ({'truncated' if change < 0 else 'longer than its manifest says'})"
    )
    assert lines[1].startswith("Hint: restore the state directory from a checkpoint")
    assert "Traceback" not in result.stderr and "reshape" not in result.stderr


def test_a_truncated_row_file_is_a_state_error_in_the_library_too(state):
    os.truncate(state / "weight.rows", HEADER_BYTES + 10 * 32 + 5)
    inspector = StateInspector(state)
    for read in (
        lambda: inspector.summary("weight"),
        lambda: inspector.read_rows("weight", [0, 1]),
        lambda: inspector.statistics("weight"),
        lambda: inspector.check("weight"),
    ):
        with pytest.raises(StateError, match=r"is 4,421 bytes, but 1,000 rows .* need 36,096 \(truncated\)"):
            read()


def test_a_truncated_disk_table_is_a_clean_error_naming_the_table(table_state):
    state, table = table_state
    spec = weight_spec("w|m|v")
    os.truncate(table, spec.file_bytes - spec.row_bytes)
    result = invoke("inspect-state", state)
    assert result.exit_code == 1
    assert (
        f"Error: row file '{table.resolve()}' of parameter 'weight' is {spec.file_bytes - spec.row_bytes:,} bytes"
        in result.stderr
    )
    assert f"need {spec.file_bytes:,} (truncated)" in result.stderr
    assert "Hint: restore the state directory (and its disk table) from a checkpoint" in result.stderr


# -- --check ---------------------------------------------------------------------------------
def test_check_passes_a_healthy_directory_reading_only_what_holds_data(state):
    result = invoke("inspect-state", state, "--check")
    assert result.exit_code == 0, result.stderr
    assert "check: no problems in 1,000 rows of 1 parameter" in result.stdout
    doc = json.loads(invoke("inspect-state", state, "--check", "--json").stdout)
    check = doc["check"]
    assert check["ok"] is True and check["rows_scanned"] == ROWS
    assert 0 < check["rows_read"] < ROWS  # holes (untouched rows) are skipped, not read
    assert check["params"]["weight"] == {"rows": ROWS, "rows_read": check["rows_read"], "bad_rows": 0, "problems": {}}


def test_check_finds_exactly_the_rows_with_nan_inf_or_negative_v(state):
    path, spec = state / "weight.rows", weight_spec()
    poke(path, spec, 2, "v", float("nan"), element=3)  # a touched row
    poke(path, spec, 700, "v", -1e-3, element=1)  # a row in a hole: written data now
    poke(path, spec, 999, "m", float("inf"))
    result = invoke("inspect-state", state, "--check")
    assert result.exit_code == 1, result.stderr
    assert "check: 3 bad rows in 1,000 rows of 1 parameter" in result.stdout
    assert "weight: 1 row where v is NaN or infinite (row 2)" in result.stdout
    assert "weight: 1 row where v is negative (row 700)" in result.stdout
    assert "weight: 1 row where m is NaN or infinite (row 999)" in result.stdout
    result = invoke("inspect-state", state, "--check", "--json")
    assert result.exit_code == 1
    check = json.loads(result.stdout)["check"]
    assert check["ok"] is False
    assert check["params"]["weight"]["bad_rows"] == 3
    assert check["params"]["weight"]["problems"] == {
        "m_not_finite": {"rows": 1, "first": [999]},
        "v_not_finite": {"rows": 1, "first": [2]},
        "v_negative": {"rows": 1, "first": [700]},
    }


def test_check_counts_every_bad_row_and_lists_the_first_few(state):
    path, spec = state / "weight.rows", weight_spec()
    for row in range(100, 140):
        poke(path, spec, row, "v", -1.0)
    check = StateInspector(state).check("weight")
    assert check["bad_rows"] == 40
    assert check["problems"] == {"v_negative": {"rows": 40, "first": [100, 101, 102, 103, 104]}}


def test_check_finds_a_non_finite_weight_in_a_disk_table(table_state):
    state, table = table_state
    spec = weight_spec("w|m|v")
    poke(table, spec, 42, "w", float("nan"))
    poke(table, spec, 3, "v", float("-inf"))
    result = invoke("inspect-state", state, "--check", "--json")
    assert result.exit_code == 1, result.stderr
    problems = json.loads(result.stdout)["check"]["params"]["weight"]["problems"]
    assert problems == {
        "w_not_finite": {"rows": 1, "first": [42]},
        "v_not_finite": {"rows": 1, "first": [3]},
        "v_negative": {"rows": 1, "first": [3]},
    }


def test_check_streams_in_chunks_of_a_few_thousand_rows(tmp_path, monkeypatch):
    emb = torch.nn.Embedding(20_000, 8, sparse=True)
    path = tmp_path / "dense"
    with DiskSparseAdam(emb.named_parameters(), state_dir=path) as opt:
        emb(torch.arange(20_000)).sum().backward()  # every row touched: no holes to skip
        opt.step()
    spec = RowSpec("weight", (20_000, 8), "float32", "")
    poke(path / "weight.rows", spec, 19_999, "v", float("nan"), element=7)  # the very last value
    reads = []
    real = os.pread
    monkeypatch.setattr(inspect_module.os, "pread", lambda fd, n, at: reads.append(n) or real(fd, n, at))
    check = StateInspector(path).check("weight")
    assert check["rows_read"] == 20_000 and check["problems"] == {"v_not_finite": {"rows": 1, "first": [19_999]}}
    assert len(reads) >= 5 and max(reads) <= 4096 * spec.row_bytes
