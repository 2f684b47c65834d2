"""Write tests/fixtures/ogb_evaluator.json: what OGB's own ``Evaluator`` says of small random
score arrays, for tests/test_ogb_protocol.py to check dsa_train.eval.ogb_protocol against.

Run it in a virtual environment of its own, never the project's (ogb is not a dependency):

    python3 -m venv /tmp/ogbvenv
    /tmp/ogbvenv/bin/pip install torch==2.13.0 ogb==1.3.6
    /tmp/ogbvenv/bin/python scripts/peers/ogb_evaluator_fixture.py tests/fixtures/ogb_evaluator.json

The cases: continuous scores (no ties), scores rounded to a few levels (many ties between the
answer and its negatives, and among negatives), an answer equal to every negative, and -inf
and NaN scores (how OGB's comparisons treat them). Each case is evaluated in batches as OGB's
examples do (the per-query lists concatenated, then averaged) and whole; the per-query lists
are kept too. Scores are JSON numbers (NaN and Infinity as Python's json writes them).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import ogb
import torch
from ogb.linkproppred import Evaluator


def cases() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(47)
    out = {}
    out["continuous"] = (rng.normal(size=40), rng.normal(size=(40, 25)))
    out["ties"] = (rng.integers(0, 4, size=60).astype(np.float64), rng.integers(0, 4, size=(60, 12)).astype(np.float64))
    out["all_equal"] = (np.zeros(5), np.zeros((5, 500)))
    pos, neg = rng.normal(size=6).astype(np.float32), rng.normal(size=(6, 500)).astype(np.float32)
    neg[::2, ::7] = pos[::2, None]  # exact ties at full width
    out["wide_float32"] = (pos, neg)
    pos, neg = rng.normal(size=12), rng.normal(size=(12, 8))
    neg[0, :3] = np.nan
    neg[1, :] = -np.inf
    pos[2] = np.nan
    pos[3] = -np.inf
    out["nan_inf"] = (pos, neg)
    return out


def main(path: str) -> None:
    evaluator = {name: Evaluator(name=name) for name in ("ogbl-wikikg2", "ogbl-biokg")}
    found = {"ogb_version": ogb.__version__, "torch_version": torch.__version__, "cases": {}}
    for name, (pos, neg) in cases().items():
        results = {}
        for dataset, ev in evaluator.items():
            lists: dict[str, list] = {}
            for start in range(0, len(pos), 7):  # batches, as OGB's examples evaluate
                out = ev.eval(
                    {
                        "y_pred_pos": torch.from_numpy(pos[start : start + 7]),
                        "y_pred_neg": torch.from_numpy(neg[start : start + 7]),
                    }
                )
                for key, value in out.items():
                    lists.setdefault(key, []).append(value)
            whole = {k: torch.cat(v) for k, v in lists.items()}
            results[dataset] = {
                "mrr": whole["mrr_list"].mean().item(),
                "hits@1": whole["hits@1_list"].mean().item(),
                "hits@3": whole["hits@3_list"].mean().item(),
                "hits@10": whole["hits@10_list"].mean().item(),
                "mrr_list": whole["mrr_list"].tolist(),
            }
        assert results["ogbl-wikikg2"] == results["ogbl-biokg"], name  # one metric, one code path
        found["cases"][name] = {
            "y_pred_pos": pos.astype(np.float64).tolist(),  # float32 values are exact in float64
            "y_pred_neg": neg.astype(np.float64).tolist(),
            "dtype": str(pos.dtype),
            "ogb": results["ogbl-wikikg2"],
        }
    with open(path, "w") as f:
        json.dump(found, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path} (ogb {ogb.__version__}, torch {torch.__version__})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/ogb_evaluator.json")
