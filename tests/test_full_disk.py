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


from .helpers import small_tmpfs

CHILD = textwrap.dedent(
    """
    import json, os, shutil, sys
    import torch
    from dsa_train import DiskSparseAdam, StateError
    from dsa_train.storage import row_file

    def fill(folder, leave):  # (tests.helpers.fill: not imported, it would import the whole trainer)
        room = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize - leave
        with open(os.path.join(folder, "filler"), "wb") as f:
            try:
                while room > 0:
                    room -= f.write(bytes(min(room, 1 << 20)))
                    f.flush()
            except OSError:
                pass

    disk, real = {disk!r}, row_file.pagemap_readable
    rows, dim = 200_001, 8  # a 12.8 MB row file, sparse, on a 4 MB file system; its last page is partly a record
    for mapping in ("private", "shared"):
        row_file.pagemap_readable = real if mapping == "private" else (lambda: False)
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
        out = {{"mapping": mapping, "shared": opt._store.files["w"].residency is None}}
        print("stepping", mapping, file=sys.stderr, flush=True)  # (a SIGBUS ends the process here)
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
        shutil.rmtree(os.path.join(disk, "state"))
        print(json.dumps(out), flush=True)
    """
)


def test_a_step_on_a_full_file_system_is_a_state_error_not_a_sigbus(tmp_path):
    """Both mappings in one child process (one start-up of torch): private, then shared."""
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        script = CHILD.format(disk=str(disk))
        child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode != -signal.SIGBUS, (
        f"SIGBUS: a step wrote into a hole of the mapping on a full disk: {child.stderr[-500:]}"
    )
    assert child.returncode == 0, child.stderr[-2000:]
    results = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    assert [(r["mapping"], r["shared"]) for r in results] == [("private", False), ("shared", True)]
    for out in results:
        assert out["full"].startswith("the disk is full: no room for the rows this step writes"), out
        assert out["unchanged"], f"the refused step changed the weights: {out}"
        assert out["equal"], f"after space was freed the step is not SparseAdam's: {out}"
        assert out["size"][0] == out["size"][1], f"the row file changed size: {out}"
