"""The scalar RM end to end (synthetic groups -> build -> train -> resume -> eval, ensemble): slow."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, check=True, capture_output=True, text=True)


@pytest.mark.slow
def test_rm_demo_and_ensemble(tmp_path):
    wd = tmp_path / "demo"
    _run("launch.rm_demo", f"--workdir={wd}", "--prompts=40", "--steps=6")
    report = json.load(open(wd / "report.json"))
    h = next(iter(report["members"].values()))["heldout"]
    for key in ("kendall_tau_b", "spearman", "pairwise_accuracy"):
        assert key in h["ranking"]
    assert {"nll", "brier", "ece"} <= set(h["calibration_after"])
    assert os.path.isfile(wd / "reliability.png")
    m = report["manifest"]
    assert m["tokenizer_sha256"] and m["chat_template_sha256"] and m["data_sha256"] and m["anchor_set_id"]
    # a second member, resumed halfway (the rerun continues from its checkpoint), then the ensemble
    w2 = tmp_path / "b"
    common = ("--config=configs/rm_tiny.py", f"--workdir={w2}", f"--data={wd / 'pairs'}", "--config.seed=1",
              "--config.rm.checkpoint_every=3", "--config.train.tensorboard=False")
    _run("launch.rm_train", *common, "--config.rm.steps=3")
    _run("launch.rm_train", *common, "--config.rm.steps=6")
    rows = [json.loads(x) for x in open(w2 / "metrics.jsonl")]
    assert rows[-1]["step"] == 6
    out = tmp_path / "ens"
    bench = tmp_path / "rb.jsonl"
    with open(bench, "w") as f:     # a text-only benchmark file, one row unreadable
        f.write(json.dumps({"id": "1", "prompt": "draw a red star", "chosen": "Done: a red star.",
                            "rejected": "Here is a blue circle.", "subset": "chat"}) + "\n{bad\n")
    _run("launch.rm_eval", f"--workdir={wd / 'run'},{w2}", f"--out={out}", f"--benchmark=rewardbench:{bench}")
    ens = json.load(open(out / "rm_eval.json"))
    assert set(ens["ensemble"]) == {"mean", "min", "std"} and len(ens["members"]) == 2
    rb = ens["benchmarks"]["rewardbench"]
    assert rb["n"] == 1 and rb["parse_failures"] == 1 and rb["accuracy"] in (0.0, 1.0)
