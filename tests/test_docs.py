"""The docs' code is the code of tests: every ``python`` block of the user-facing docs
runs on 2 real ranks (``tests/parallel/snippets.py``), inside a harness that gives it
the names a reader's script would already have.

A block is marked by the line before its fence, ``<!-- test: HARNESS -->`` (the
harnesses are in ``tests/parallel/snippets.py``); a block that cannot run here says
why, ``<!-- test: skip REASON -->``. An unmarked block fails
``test_every_block_is_marked``, so a new snippet cannot go untested by accident.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from conftest import ROOT, horovodrun, load_ranks

sys.path.insert(0, str(ROOT / "tests" / "parallel"))
from snippets import HARNESSES  # noqa: E402

DOCS = ["README.md", "docs/quickstart.md", "docs/tensorflow.md", "docs/ddp.md"]
#: Whole scripts for torchrun (no Horovod), run by tests/test_ddp.py.
TORCHRUN = "ddp"
MARK = re.compile(r"<!--\s*test:\s*(\S+)(.*?)-->")


def blocks(doc: str):
    """Every fenced python block of ``doc``: (line of its first code line, marker, code)."""
    lines = (ROOT / doc).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            m = MARK.search(lines[i - 1]) if i else None
            out.append((i + 1, m.group(1) if m else None, "\n".join(lines[i + 1 : j]) + "\n"))
            i = j
        i += 1
    return out


def snippets(framework: str):
    found = []
    for doc in DOCS:
        for line, harness, code in blocks(doc):
            if harness and harness != "skip" and harness.split("-")[0] == framework:
                found.append({"doc": doc, "line": line, "harness": harness, "code": code})
    return found


def test_every_block_is_marked():
    for doc in DOCS:
        for line, harness, _ in blocks(doc):
            assert harness is not None, f"{doc}:{line}: python block without <!-- test: ... -->"
            assert harness in ("skip", TORCHRUN) or harness in HARNESSES, (
                f"{doc}:{line}: unknown harness {harness!r}; known: {sorted(HARNESSES)}"
            )
    # The marks cover what the README and quick start promise a newcomer.
    assert len(snippets("torch")) >= 7 and len(snippets("tf")) >= 5


@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_snippets_run(framework, tmp_path):
    found = snippets(framework)
    spec = tmp_path / "snippets.json"
    spec.write_text(json.dumps(found))
    horovodrun("gloo", 2, [ROOT / "tests/parallel/snippets.py", spec, tmp_path], timeout=420)
    ranks = load_ranks(tmp_path, 2)
    for s in found:
        key = f"{s['doc']}:{s['line']}"
        recs = [r[key] for r in ranks]
        for rank, rec in enumerate(recs):
            if not rec["ok"]:
                pytest.fail(f"{key} ({s['harness']}) failed on rank {rank}:\n{rec['error']}")
        assert recs[0]["digest"] == recs[1]["digest"], f"{key}: ranks' parameters differ"
        if not s["harness"].endswith("-trained"):
            assert recs[0]["changed"], f"{key}: training left the parameters unchanged"
        # Every dlgs object left in the snippet's names has run its exchange.
        steps = recs[0]["exchange_steps"]
        assert all(n > 0 for n in steps.values()), f"{key}: an exchange never stepped: {steps}"
        if "torch.save" in s["code"]:
            assert f"ckpt.{0}.pt" in recs[0]["files"] and "ckpt.1.pt" in recs[1]["files"]
