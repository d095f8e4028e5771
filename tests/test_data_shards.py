"""Committed data sets are closed: every shard data/manifest.json lists is there with the content it recorded
(not appended to, not rewritten, not removed), and no new shard is numbered among the closed ones. A shard may
change only its container (plain -> gzip) with the same conversations inside."""

import gzip
import hashlib
import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "data"
MANIFEST = json.loads((DATA / "manifest.json").read_text())


def content(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if path.name.endswith(".gz") else raw


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_closed_shards_hold_what_the_manifest_recorded(name):
    folder, record = DATA / name, MANIFEST[name]
    changed = []
    for shard in record["shards"]:
        path = folder / shard["file"]
        if not path.exists():  # closed later by compressing it: the same conversations inside
            path = folder / (shard["file"] + ".gz")
        if not path.exists():
            changed.append(f"{shard['file']}: missing")
            continue
        body = content(path)
        if hashlib.sha256(body).hexdigest() != shard["content_sha256"]:
            lines = body.count(b"\n")
            changed.append(f"{path.name}: {lines} conversations, the manifest {shard['conversations']}")
        elif path.name == shard["file"] and hashlib.sha256(path.read_bytes()).hexdigest() != shard["sha256"]:
            changed.append(f"{path.name}: the same conversations, another file")  # rewritten: a clone grows
    assert not changed, f"closed shards of data/{name} changed: {changed}"
    assert sum(s["conversations"] for s in record["shards"]) == record["conversations"]


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_no_other_shard_among_the_closed_ones(name):
    """Training reads every part-* file of the folder: a second copy of a closed shard (plain beside gzip) or a
    new shard numbered among them would add conversations to the data set."""
    files = [s["file"] for s in MANIFEST[name]["shards"]]
    last = max(f.removesuffix(".gz") for f in files)
    present = sorted(p.name for p in (DATA / name).glob("part-*") if p.name.removesuffix(".gz") <= last)
    expected = sorted(f if (DATA / name / f).exists() else f + ".gz" for f in files)
    assert present == expected, f"data/{name}: {sorted(set(present) - set(expected))} beside the closed shards"
