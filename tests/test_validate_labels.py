"""Label validation (rm_jax.label.validate, launch.validate_labels) on synthetic labels.

The synthetic labels are the ground truth, so they are the "clean teacher"; the corrupted copy
does what the field report's v1 teacher did: text-only passes flipped to fail at 40% with an
invented tool-call issue.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from rm_jax.data import synth
from rm_jax.label import validate as V

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_FLAGS = {V.FLAG_FLAT, V.FLAG_ROUTE_RATIO, V.FLAG_TOOL_ISSUE}


def _write(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


def corrupt(samples: list[dict], rate: float = 0.4, issue: str = "wrong_param", seed: int = 0) -> tuple[list[dict], int]:
    rng = random.Random(seed)
    out, flipped = [], 0
    for s in samples:
        s = json.loads(json.dumps(s))
        if not s["response"]["tool_calls"] and s["label"]["l3"] == "pass" and rng.random() < rate:
            s["label"] = {"l3": "fail", "reason": "the tool call's resolution parameter misses the requested 2K",
                          "issues": [issue], "img": s["label"]["img"]}
            flipped += 1
        out.append(s)
    return out, flipped


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    d = tmp_path_factory.mktemp("val")
    samples = synth.generate(synth.SynthConfig(n=1500, seed=1, fail_rate=0.08), str(d))
    bad, flipped = corrupt(samples)
    return d, samples, _write(d / "clean.jsonl", samples), _write(d / "bad.jsonl", bad), flipped


def test_clean_synthetic_labels_raise_no_flag(labelled):
    _, samples, clean, _, _ = labelled
    rep = V.validate(clean)
    assert rep.flags == [], rep.flags
    assert rep.n_rows == len(samples) and not rep.unreadable
    judged = [b for b in rep.bins if b.judged]
    assert len(judged) >= 3
    # Sound labels: near-copies of the reply that went out almost all pass.
    assert judged[-1].fail_rate < 0.1 * rep.text_only_fail_rate
    n_text = sum(not s["response"]["tool_calls"] for s in samples)
    assert sum(b.n for b in rep.bins) == rep.text_only_with_reference == n_text
    assert sum(b.fail for b in rep.bins) == sum(not s["response"]["tool_calls"] and s["label"]["l3"] == "fail"
                                               for s in samples)


def test_corrupted_labels_raise_all_three_flags(labelled):
    _, _, _, bad, flipped = labelled
    assert flipped > 100
    rep = V.validate(bad)
    assert {f.name for f in rep.flags} == ALL_FLAGS, rep.flags
    assert len(rep.tool_issue_rows) == flipped
    assert rep.route_comparison["ratio"] >= 3
    assert rep.issues_by_route["text_only"]["wrong_param"] == flipped


def test_flags_are_specific(labelled, tmp_path):
    """Flipped with a text-only issue type: the rates are still flat and lopsided, but no
    tool-call issue is filed against a text answer."""
    _, samples, _, _, _ = labelled
    rows, _ = corrupt(samples, issue="false_completion_claim")
    rep = V.validate(_write(tmp_path / "b.jsonl", rows))
    assert {f.name for f in rep.flags} == {V.FLAG_FLAT, V.FLAG_ROUTE_RATIO}


def _row(i, content, ref, l3, tool=False, issues=()):
    resp = {"content": None if tool else content,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] if tool else []}
    return {"id": f"r{i}", "messages": [{"role": "user", "content": "x"}], "response": resp,
            "reference_reply": ref, "label": {"l3": l3, "reason": "", "issues": list(issues), "img": None}}


def test_similarity_binning_and_unreadable_lines(tmp_path):
    rows = [_row(0, "abcdefghij", "abcdefghij", "pass"),            # 1.0 -> 0.8-1.0
            _row(1, "aaaaaaaaaa", "bbbbbbbbbb", "fail"),            # 0.0 -> 0.0-0.2
            _row(2, "abcde", "abcdefghijklmnopqrst", "fail"),       # 2*5/25 = 0.4 -> 0.4-0.6
            _row(3, "ab", "abcdefghijklmnopqr", "pass"),            # 2*2/20 = 0.2 -> 0.2-0.4
            _row(4, "x", None, "fail"),                             # no reference: not binned
            _row(5, None, None, "fail", tool=True)]
    path = _write(tmp_path / "l.jsonl", rows)
    with open(path, "a") as f:
        f.write("{not json\n")
        f.write(json.dumps(_row(0, "dup", "dup", "pass")) + "\n")
    rep = V.validate(path)
    assert [(b.name, b.n, b.fail) for b in rep.bins] == [
        ("0.0-0.2", 1, 1), ("0.2-0.4", 1, 0), ("0.4-0.6", 1, 1), ("0.6-0.8", 0, 0), ("0.8-1.0", 1, 0)]
    assert rep.text_only_without_reference == 1 and rep.n_rows == 6
    assert [u.line for u in rep.unreadable] == [7, 8]
    assert "duplicate id r0" in rep.unreadable[1].detail
    assert rep.flags == []      # far too few rows to judge anything


def test_route_ratio_needs_more_than_chance(tmp_path):
    def rows(n, fails_text, fails_tool):
        out = [_row(i, f"t{i}", None, "fail" if i < fails_text else "pass") for i in range(n)]
        out += [_row(n + i, None, None, "fail" if i < fails_tool else "pass", tool=True) for i in range(n)]
        return out
    small = V.validate(_write(tmp_path / "s.jsonl", rows(25, 4, 1)))       # ratio 4, z ~1.4
    assert small.route_comparison["ratio"] == 4.0 and small.route_comparison["z"] < 2
    assert V.FLAG_ROUTE_RATIO not in {f.name for f in small.flags}
    big = V.validate(_write(tmp_path / "b.jsonl", rows(400, 64, 16)))      # ratio 4, z ~6
    assert V.FLAG_ROUTE_RATIO in {f.name for f in big.flags}
    assert "text_only fails 4.0x" in next(f.detail for f in big.flags if f.name == V.FLAG_ROUTE_RATIO)


def test_migration_matrix(labelled):
    _, samples, clean, bad, flipped = labelled
    rep = V.validate(bad, clean)
    m = rep.migration
    n_fail = sum(s["label"]["l3"] == "fail" for s in samples)
    assert m["compared"] == len(samples)
    assert m["matrix"] == {"pass->pass": len(samples) - n_fail - flipped, "pass->fail": flipped,
                           "fail->pass": 0, "fail->fail": n_fail}
    assert m["unchanged"] == len(samples) - flipped and m["fail_to_pass"] == 0
    assert m["by_route"]["tool_call"]["pass->fail"] == 0 and m["by_route"]["text_only"]["pass->fail"] == flipped
    assert set(m["examples"]) == {"pass->pass", "pass->fail", "fail->fail"}
    ex = m["examples"]["pass->fail"]
    assert ex["route"] == "text_only" and ex["issues"] == ["wrong_param"] and ex["previous_issues"] == []


def test_cli_writes_report_plots_examples(labelled, tmp_path):
    _, _, clean, bad, _ = labelled
    out = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run([sys.executable, "-m", "launch.validate_labels", f"--labels={bad}", f"--previous={clean}",
                          f"--out={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads((out / "report.json").read_text())
    assert {f["name"] for f in rep["flags"]} == ALL_FLAGS
    assert all(set(f) == {"name", "detail"} and f["detail"] for f in rep["flags"])
    assert [b["bin"] for b in rep["similarity"]["bins"]] == ["0.0-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-1.0"]
    md = (out / "report.md").read_text()
    assert "| 0.8-1.0 |" in md and "## Migration" in md and V.FLAG_TOOL_ISSUE in md
    for p in rep["plots"]:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(rep["plots"]) == 3
    dumps = sorted(os.listdir(out / "examples"))
    assert dumps == [f"similarity_{b}.jsonl" for b in ("0.0-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-1.0")]
    top = [json.loads(x) for x in (out / "examples" / "similarity_0.8-1.0.jsonl").read_text().splitlines()]
    assert top and all(0.8 <= x["similarity"] <= 1.0 and x["reference_reply"] for x in top)
    assert "FLAG route_fail_rate_ratio" in res.stdout


def test_a_teacher_that_passes_everything_is_flat(labelled, tmp_path):
    _, samples, _, _, _ = labelled
    rows = [dict(s, label=dict(s["label"], l3="pass", issues=[])) for s in samples]
    rep = V.validate(_write(tmp_path / "all_pass.jsonl", rows))
    assert [f.name for f in rep.flags] == [V.FLAG_FLAT] and "passes everything" in rep.flags[0].detail
