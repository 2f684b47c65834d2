"""A full disk during a step, on a real file system that fills up (a small tmpfs, mounted as
root; skipped with the reason where that is impossible): the rows' pages are allocated before
the step writes them, so a step on a full disk is a ``StateError`` and never a ``SIGBUS`` of a
write into a hole of the mapping, with the row files mapped privately (the default) and
shared (where ``/proc/self/pagemap`` is hidden). Once space is freed the step is
torch.optim.SparseAdam's, and the row file keeps its size (a header and whole records)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import small_tmpfs

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from dsa_train import DiskSparseAdam, StateError
    from dsa_train.optim import row_file
    from tests.helpers import fill

    disk, mapping = {disk!r}, {mapping!r}
    if mapping == "shared":
        row_file.pagemap_readable = lambda: False
    rows, dim = 200_001, 8  # a 12.8 MB row file, sparse, on a 4 MB file system; its last page is partly a record
    ours = torch.nn.Parameter(torch.randn(rows, dim))
    theirs = torch.nn.Parameter(ours.detach().clone())
    reference = torch.optim.SparseAdam([theirs], lr=0.01)
    opt = DiskSparseAdam([("w", ours)], lr=0.01, state_dir=os.path.join(disk, "state"), memory_budget=0)
    path = os.path.join(disk, "state", "w.rows")
    size = os.path.getsize(path)
    picked = torch.cat([torch.arange(0, rows, 997), torch.tensor([rows - 1])])  # 202 rows on pages of their own
    grad = torch.sparse_coo_tensor(picked[None], torch.randn(len(picked), dim), (rows, dim))
    fill(disk, leave=16 << 10)  # room for the manifest, not for the rows' pages
    ours.grad = grad
    out = {{}}
    try:
        opt.step()
        out["full"] = "stepped"
    except StateError as e:
        out["full"] = str(e)
    out["unchanged"] = bool(torch.equal(ours, theirs))
    os.unlink(os.path.join(disk, "filler"))  # space freed
    for p in (ours, theirs):
        p.grad = grad
    opt.step()
    reference.step()
    out["equal"] = bool(torch.equal(ours, theirs))
    opt.close()
    out["size"] = [size, os.path.getsize(path)]
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("mapping", ["private", "shared"])
def test_a_step_on_a_full_file_system_is_a_state_error_not_a_sigbus(tmp_path, mapping):
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        script = CHILD.format(disk=str(disk), mapping=mapping)
        child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert child.returncode != -signal.SIGBUS, "SIGBUS: the step wrote into a hole of the mapping on a full disk"
    assert child.returncode == 0, child.stderr[-2000:]
    out = json.loads(child.stdout.splitlines()[-1])
    assert out["full"].startswith("the disk is full: no room for the rows this step writes"), out
    assert out["unchanged"], "the refused step changed the weights"
    assert out["equal"], "after space was freed the step is not SparseAdam's"
    assert out["size"][0] == out["size"][1], f"the row file changed size: {out['size']}"
