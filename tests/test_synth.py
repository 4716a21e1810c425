"""The synthetic data set (rm_jax.data.synth) and its tokenizer directory (tokenizer_build).

One 2000-sample set is generated per module (a few seconds) and shared by the tests.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import string
import subprocess
import sys

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from configs import judge_contracts, tiny
from launch.common import REPO_ROOT
from rm_jax.data import synth
from rm_jax.eval.presence import copy_match, read_presence_aucs

N = 2000


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synth"))
    summary = synth.write_dataset(out, N, seed=0, fail_rate=0.08)
    with open(os.path.join(out, "samples.jsonl"), encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    return out, samples, summary


# ---------------------------------------------------------------- a small local contract check


def _decode_args(args):
    """Returns (object, number of JSON decodes needed)."""
    depth = 0
    while isinstance(args, str) and depth < 4:
        args = json.loads(args)
        depth += 1
    return args, depth


def _check_parts(content, where):
    if isinstance(content, str):
        return
    assert isinstance(content, list) and content, where
    for p in content:
        assert p["type"] in ("text", "image"), where
        if p["type"] == "text":
            assert isinstance(p["text"], str), where
        else:
            assert isinstance(p["image"], str), where


def check_contract(s: dict) -> None:
    where = s.get("id")
    assert set(s) <= {"id", "prompt_id", "messages", "tools", "response", "reference_reply", "label"}, where
    assert re.fullmatch(r"p\d+-s\d+", s["id"]) and s["id"].startswith(s["prompt_id"] + "-"), where
    assert isinstance(s["messages"], list) and s["messages"], where
    for m in s["messages"]:
        assert m["role"] in ("system", "user", "assistant", "tool"), where
        if m["role"] == "assistant":
            assert "tool_calls" not in m, f"{where}: history assistant turns carry no tool_calls (online shape)"
        if m["role"] == "tool":
            assert isinstance(m["content"], str), where
            json.loads(m["content"])        # a JSON string, as online
            assert set(m) <= {"role", "tool_call_id", "name", "content"}, where
        else:
            _check_parts(m["content"], where)
    names = set()
    for t in s["tools"]:
        assert t["type"] == "function", where
        fn = t["function"]
        names.add(fn["name"])
        params = fn["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"]), where
    resp = s["response"]
    assert set(resp) == {"content", "tool_calls"}, where
    assert resp["content"] is None or isinstance(resp["content"], str), where
    assert resp["content"] or resp["tool_calls"], where
    for c in resp["tool_calls"]:
        assert c["type"] == "function" and c["id"], where
        assert c["function"]["name"] in names, f"{where}: calls a tool the sample does not list"
        args, _ = _decode_args(c["function"]["arguments"])
        assert isinstance(args, dict), where
        props = next(t for t in s["tools"] if t["function"]["name"] == c["function"]["name"])["function"]["parameters"]
        assert set(args) <= set(props["properties"]), where
        for k, v in args.items():
            enum = synth.TOOLS[c["function"]["name"]]["function"]["parameters"]["properties"][k].get("enum")
            assert enum is None or v in enum, f"{where}: {k}={v!r} not in the schema enum"
    if not resp["tool_calls"]:
        assert isinstance(s.get("reference_reply"), str) and s["reference_reply"], where
    lab = s["label"]
    assert list(lab) == ["l3", "reason", "issues", "img"], where
    assert lab["l3"] in ("pass", "fail") and isinstance(lab["reason"], str) and lab["reason"], where
    assert "\n" not in lab["reason"] and len(lab["reason"]) < 160, where
    assert isinstance(lab["issues"], list) and (lab["issues"] == []) == (lab["l3"] == "pass"), where
    family = judge_contracts.TOOL_CALL_ISSUES if resp["tool_calls"] else judge_contracts.TEXT_ONLY_ISSUES
    assert all(i in family for i in lab["issues"]), f"{where}: issue from the wrong contract"
    assert lab["img"] is None or (isinstance(lab["img"], int) and 0 <= lab["img"] <= 10), where


def conversation_images(s: dict) -> list[str]:
    out = []
    for m in s["messages"]:
        c = m["content"]
        if m["role"] == "tool":
            payload = json.loads(c)
            out += [im["image"] for im in payload.get("images", [])]
        elif isinstance(c, list):
            out += [p["image"] for p in c if p["type"] == "image"]
    return out


def _reference_images(out: str) -> list[str]:
    """images/<folder>/ref.png: one reference image per prompt that has one."""
    root = os.path.join(out, "images")
    return [os.path.join(root, d, "ref.png") for d in sorted(os.listdir(root))
            if os.path.isfile(os.path.join(root, d, "ref.png"))]


def test_generated_files_are_named_by_one_token_stems(dataset):
    """A generated image is images/<k in letters>/<stem>.png; a note's cited file differs from the tool
    result's in one token (the stem) when it is hallucinated."""
    _, samples, _ = dataset
    edits_elsewhere = 0
    folder_of: dict[str, str] = {}          # prompt_id -> its one image folder
    for s in samples:
        called = [v for c in s["response"]["tool_calls"] for v in _decode_args(c["function"]["arguments"])[0].values()
                  if isinstance(v, str) and v.startswith("images/")]
        for path in conversation_images(s) + called:
            folder, name = path.split("/")[1:]
            assert re.fullmatch("[a-z]+", folder), (s["id"], path)     # letters: no digit to read as a count
            assert folder_of.setdefault(s["prompt_id"], folder) == folder, (s["id"], path)
            assert name[:-4] in (*synth.FILE_STEMS, "ref"), (s["id"], path)
        # A call on an image no tool result returned names another stem in the same folder.
        edits_elsewhere += bool(set(called) - set(conversation_images(s)))
    assert edits_elsewhere
    assert len(set(folder_of.values())) == len(folder_of) > 1              # one prompt's folder is its own
    halluc = [s for s in samples if s["label"]["issues"] == ["text_hallucination"]]
    assert halluc
    for s in halluc:
        returned = {p.split("/")[-1] for p in conversation_images(s)}
        cited = re.search(r"(\w+\.png)", s["response"]["content"]).group(1)
        assert cited not in returned and cited[:-4] in synth.FILE_STEMS, s["id"]


# ---------------------------------------------------------------- tests


def test_contract_and_images(dataset):
    out, samples, summary = dataset
    assert len(samples) == N == summary["n"]
    assert len({s["id"] for s in samples}) == N
    for s in samples:
        check_contract(s)
        imgs = conversation_images(s)
        assert len(imgs) <= 2, s["id"]
        for p in imgs:
            assert os.path.isfile(os.path.join(out, p)), f"{s['id']}: {p} missing"
        # img is null exactly when the conversation holds no image.
        assert (s["label"]["img"] is None) == (not imgs), s["id"]
    assert any(conversation_images(s) for s in samples) and any(not conversation_images(s) for s in samples)


def test_listed_schemas_leave_out_the_enums(dataset):
    """A sample lists its tools without enum lists (the catalogue keeps them): an enum names every
    value of its pool, so with it a wrong value would appear in the judge's input as often as the
    right one. Everything else a judge or the rules check (types, ranges, required) is listed."""
    _, samples, _ = dataset
    for s in samples:
        for t in s["tools"]:
            fn = t["function"]
            full = synth.TOOLS[fn["name"]]["function"]
            assert fn["parameters"]["required"] == full["parameters"]["required"], s["id"]
            assert fn["parameters"]["properties"].keys() == full["parameters"]["properties"].keys()
            for k, prop in fn["parameters"]["properties"].items():
                assert "enum" not in prop, f"{s['id']}: {fn['name']}.{k} lists its enum"
                assert prop == {a: b for a, b in full["parameters"]["properties"][k].items() if a != "enum"}
    assert any("enum" in p for t in synth.TOOLS.values() for p in t["function"]["parameters"]["properties"].values())


def test_reference_images_are_varied_non_square(dataset):
    from PIL import Image
    out, _, _ = dataset
    refs = _reference_images(out)[:40]
    sizes = [Image.open(f).size for f in refs]
    assert all(w != h and 40 <= w <= 64 and 40 <= h <= 64 for w, h in sizes)
    assert len(set(sizes)) > 10


def test_online_shape(dataset):
    _, samples, _ = dataset
    tool_msgs = [m for s in samples for m in s["messages"] if m["role"] == "tool"]
    assert any("tool_call_id" in m for m in tool_msgs) and any("tool_call_id" not in m for m in tool_msgs)
    depths = collections.Counter(_decode_args(c["function"]["arguments"])[1]
                                 for s in samples for c in s["response"]["tool_calls"])
    assert set(depths) == {0, 1, 2}, depths     # object, JSON string, double-encoded


def test_label_mix(dataset):
    _, samples, summary = dataset
    n_fail = sum(s["label"]["l3"] == "fail" for s in samples)
    rate = n_fail / len(samples)
    print(f"fail rate {rate:.4f}, tool-call share {summary['tool_call_share']:.3f}")
    assert abs(rate - 0.08) < 0.025
    assert 0.45 < summary["tool_call_share"] < 0.65
    issues = collections.Counter(i for s in samples for i in s["label"]["issues"])
    assert len(set(issues) & set(judge_contracts.TOOL_CALL_ISSUES)) >= 4, issues
    assert len(set(issues) & set(judge_contracts.TEXT_ONLY_ISSUES)) >= 4, issues
    # Groups of 3 per prompt; some groups mix verdicts (what GRPO needs).
    groups = collections.defaultdict(set)
    for s in samples:
        groups[s["prompt_id"]].add(s["label"]["l3"])
    assert max(len([s for s in samples if s["prompt_id"] == "p0"]), 1) == 3
    assert sum(len(v) == 2 for v in groups.values()) >= 20


def test_fail_rate_flag(tmp_path):
    samples = synth.generate(synth.SynthConfig(n=900, seed=3, fail_rate=0.3), str(tmp_path))
    rate = np.mean([s["label"]["l3"] == "fail" for s in samples])
    assert abs(rate - 0.3) < 0.06, rate


def _digest(folder: str) -> str:
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(folder)):
        for f in sorted(files):
            h.update(f.encode())
            with open(os.path.join(root, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def test_deterministic(tmp_path):
    a, b, c = (str(tmp_path / x) for x in "abc")
    for d, seed in ((a, 7), (b, 7), (c, 8)):
        synth.write_dataset(d, 150, seed=seed, with_tokenizer=d != c)
    assert _digest(a) == _digest(b)     # samples, images and tokenizer files
    with open(os.path.join(a, "samples.jsonl"), "rb") as fa, open(os.path.join(c, "samples.jsonl"), "rb") as fc:
        assert fa.read() != fc.read()


def test_cli(tmp_path):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "cli")
    subprocess.run([sys.executable, "-m", "launch.synth", f"--out={out}", "--n=31", "--seed=2", "--fail_rate=0.5"],
                   cwd=root, check=True, capture_output=True)
    with open(os.path.join(out, "samples.jsonl"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 31 and lines[-1].startswith('{"id": "p10-s0"')
    assert os.path.isfile(os.path.join(out, "tokenizer", "tokenizer.json"))
    assert os.path.isfile(os.path.join(out, "tokenizer", "preprocessor_config.json"))


# ---------------------------------------------------------------- no shortcut to the label

_PUNCT = set(string.punctuation)


def surface_features(resp: dict) -> list[float]:
    """Length and format of the response alone: what a lazy judge could key on."""
    content = resp["content"] or ""
    calls = resp["tool_calls"]
    raw = content + "".join(json.dumps(c, ensure_ascii=False) for c in calls)
    decoded = [_decode_args(c["function"]["arguments"]) for c in calls]
    words = re.findall(r"\w+", raw)
    return [len(raw), len(calls), float(bool(content)), float(any(ch.isdigit() for ch in raw)),
            sum(ch.isdigit() for ch in raw), max((d for _, d in decoded), default=0),
            sum(d for _, d in decoded), len(words), sum(ch in _PUNCT for ch in raw),
            sum(len(a) for a, _ in decoded), raw.count("\\"), sum(ch.isupper() for ch in raw),
            float(np.mean([len(w) for w in words])) if words else 0.0, len(content)]


def test_no_surface_shortcut(dataset):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import GroupShuffleSplit
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    _, samples, _ = dataset
    x = np.array([surface_features(s["response"]) for s in samples])
    y = np.array([s["label"]["l3"] == "fail" for s in samples], dtype=int)
    groups = [s["prompt_id"] for s in samples]
    aucs = []
    for tr, te in GroupShuffleSplit(n_splits=3, test_size=0.3, random_state=0).split(x, y, groups):
        clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, class_weight="balanced"))
        clf.fit(x[tr], y[tr])
        aucs.append(roc_auc_score(y[te], clf.predict_proba(x[te])[:, 1]))
    auc = float(np.mean(aucs))
    print(f"surface-feature logistic regression held-out AUC {auc:.3f} (splits {np.round(aucs, 3)})")
    assert auc < 0.65


# ---------------------------------------------------------------- tokenizer directory


@pytest.fixture(scope="module")
def tokenizer(dataset):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(os.path.join(dataset[0], "tokenizer"))


def test_special_tokens_and_verdict_tokens(tokenizer):
    for i, t in enumerate(tiny.SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(t) == i
    assert len(tokenizer) <= tiny.hf_model_config().text_config.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    p = tokenizer("pass", add_special_tokens=False)["input_ids"]
    f = tokenizer("fail", add_special_tokens=False)["input_ids"]
    print(f"vocab {len(tokenizer)}; pass -> {p}, fail -> {f}")
    assert p[0] != f[0]
    # In context the verdict is the same single token right after the '{"l3": "' prefix.
    prefix = tokenizer('{"l3": "', add_special_tokens=False)["input_ids"]
    for word, ids in (("pass", p), ("fail", f)):
        full = tokenizer('{"l3": "' + word + '", "reason": "x"', add_special_tokens=False)["input_ids"]
        assert full[:len(prefix)] == prefix and full[len(prefix)] == ids[0]


def test_slot_values_are_single_distinct_tokens(tokenizer):
    """A request's value and a call's value are one token, the same one in prose and in JSON, and
    no two values share it: `16:9` is not `9:16` reordered, `2K` is not the count 2 plus `K`."""
    values = [*synth.RESOLUTIONS, *synth.ASPECTS, *synth.COLOURS, *synth.SHAPES, *synth.FILE_STEMS]
    token_of = {}
    for v in values:
        prose = tokenizer(f"make it {v}, please", add_special_tokens=False)["input_ids"]
        call = tokenizer(f'{{"value": "{v}", "count": 2}}', add_special_tokens=False)["input_ids"]
        single = tokenizer(v, add_special_tokens=False)["input_ids"]
        assert len(single) == 1, (v, [tokenizer.decode([i]) for i in single])
        assert single[0] in prose and single[0] in call, v
        token_of[v] = single[0]
    assert len(set(token_of.values())) == len(values)
    counts = {tokenizer(str(c), add_special_tokens=False)["input_ids"][0] for c in synth.COUNTS}
    assert not counts & set(token_of.values())


def test_chat_template_tools_images_tool_calls(dataset, tokenizer):
    _, samples, _ = dataset
    s = next(x for x in samples if any(m["role"] == "tool" for m in x["messages"]) and x["response"]["tool_calls"])
    messages = s["messages"] + [{"role": "assistant", "content": None, "tool_calls": s["response"]["tool_calls"]}]
    text = tokenizer.apply_chat_template(messages, tools=s["tools"], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "<tools>\n" in text and "\n</tools>" in text
    for t in s["tools"]:
        assert json.dumps(t, ensure_ascii=False) in text
    assert "<|im_start|>user\n<tool_response>\n" in text and "\n</tool_response><|im_end|>" in text
    assert "<tool_call>\n{\"name\": \"" in text and "\n</tool_call>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # One pad per image, for images in content parts.
    parts = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "hi"},
                                          {"type": "image", "image": "b.png"}]}]
    t2 = tokenizer.apply_chat_template(parts, add_generation_prompt=False, tokenize=False)
    assert t2 == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi"
                  "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n")
    ids = tokenizer.apply_chat_template(parts, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids).count(tiny.SPECIAL_TOKENS.index("<|image_pad|>")) == 2


def test_image_processor(dataset):
    import transformers
    from PIL import Image
    out = dataset[0]
    proc = transformers.AutoImageProcessor.from_pretrained(os.path.join(out, "tokenizer"))
    img_cfg = tiny.get_config().data.image
    assert proc.patch_size == 8 and proc.merge_size == 2 and proc.temporal_patch_size == 2
    assert proc.size["longest_edge"] == img_cfg.max_pixels and proc.size["shortest_edge"] == img_cfg.min_pixels
    ref = _reference_images(out)[0]
    res = proc(images=[Image.open(ref).convert("RGB")], return_tensors="np")
    t, h, w = res["image_grid_thw"][0]
    assert t == 1 and h % 2 == 0 and w % 2 == 0


def test_rule_violating_samples_get_the_gate_or_the_penalty(tmp_path):
    """About rule_violation_rate of the responses break a reward rule; each is a labelled failure,
    the reward gates the malformed call and the unknown tool at -2.0 whatever the judge says, and
    charges the missing argument and the duplicate call; the baseline leaves them out."""
    from rm_jax.data import schema
    from rm_jax.eval.baseline import without_rule_violations
    from rm_jax.score.reward import compute_reward
    from rm_jax.score.rules import (DUPLICATE_CALL, MALFORMED_ARGUMENTS, MISSING_REQUIRED, UNKNOWN_TOOL,
                                    RulePenalties, rule_check)
    out = tmp_path / "d"
    summary = synth.write_dataset(str(out), n=600, seed=3, fail_rate=0.1, with_tokenizer=False,
                                  rule_violation_rate=0.2)
    with open(out / "samples.jsonl", "rb") as f:
        samples = [schema.parse_line(line, line=i + 1, base_dir=str(out)) for i, line in enumerate(f)]
    assert all(isinstance(s, schema.Sample) for s in samples)       # the parser keeps them all
    by_code = collections.Counter()
    n_violating = 0
    for s in samples:
        codes = rule_check(s).codes
        if not codes:
            continue
        n_violating += 1
        assert s.label.l3 == "fail" and len(s.label.issues) == 1, s.id
        best = compute_reward(s, p_pass=1.0, n_issues=0, img=10)   # a judge fooled completely
        if set(codes) & {MALFORMED_ARGUMENTS, UNKNOWN_TOOL}:
            assert best.reward == -2.0 and best.components["gated"]
        else:
            free = compute_reward(s, p_pass=1.0, n_issues=0, img=10,
                                  penalties=RulePenalties(missing_required=0.0, duplicate_call=0.0))
            assert best.rule_score == -1.0 * len(codes) and not best.components["gated"]
            assert best.reward == pytest.approx(free.reward - len(codes))
        by_code.update(set(codes))
    assert set(by_code) == {MALFORMED_ARGUMENTS, UNKNOWN_TOOL, MISSING_REQUIRED, DUPLICATE_CALL}
    assert 0.12 < n_violating / summary["n"] < 0.28
    # The reward report shows the rules at work: gated and penalized responses by teacher label.
    from rm_jax.eval.reward_report import format_markdown, reward_report
    records = []
    for s in samples:
        rw = compute_reward(s, p_pass=0.9, n_issues=0, img=8)
        records.append({"id": s.id, "prompt_id": s.prompt_id, "label": s.label.l3, "reward": rw.reward,
                        "rule_score": rw.rule_score, "p_pass": 0.9, "n_issues": 0, "gated": rw.components["gated"]})
    report = reward_report(records)
    n_gated = sum(r["gated"] for r in records)
    assert report["rules"]["fail"]["gated"] == n_gated > 0 and report["rules"]["pass"]["gated"] == 0
    assert report["rules"]["fail"]["penalized"] == n_violating - n_gated > 0
    assert report["rules"]["gated_rewards"] == [-2.0] and "gated 0 pass" in format_markdown(report)
    kept, n_out = without_rule_violations(samples)
    assert n_out == n_violating and len(kept) == len(samples) - n_violating
    # Without the option nothing breaks a rule: the default data set is unchanged.
    synth.write_dataset(str(tmp_path / "e"), n=300, seed=3, fail_rate=0.1, with_tokenizer=False)
    with open(tmp_path / "e" / "samples.jsonl", "rb") as f:
        plain = [schema.parse_line(line, line=i + 1, base_dir=str(tmp_path / "e")) for i, line in enumerate(f)]
    assert not any(rule_check(s).codes for s in plain)


def test_copy_match_diagnostic():
    """The presence rule's score (launch.synth_diagnose, the demo report): the share of a response's pool values seen before it."""
    call = {"id": "c", "type": "function", "function": {"name": "generate_image", "arguments": {
        "prompt": "a red star", "aspect_ratio": "4:3", "count": 2}}}
    sample = {"messages": [{"role": "system", "content": "sys"},
                           {"role": "user", "content": "I need 2 images: a red star, 16:9."}],
              "tools": [synth.TOOLS["generate_image"]],
              "response": {"content": None, "tool_calls": [call]}}
    conv, listed = copy_match(sample)
    assert conv == pytest.approx(3 / 4)          # red, star, 2 seen; 4:3 is not
    assert listed == 1.0                         # the full schema's enum names 4:3 too
    sample["tools"] = [synth.listed_schema(synth.TOOLS["generate_image"])]
    assert copy_match(sample)[1] == pytest.approx(3 / 4)


def test_copy_match_reads_the_request_without_a_system_prompt():
    """The synthetic conversations open with the user's request (no system turn): it is read."""
    call = {"id": "c", "type": "function", "function": {"name": "generate_image", "arguments": {
        "prompt": "a red star", "count": 2}}}
    sample = {"messages": [{"role": "user", "content": "I need 2 images: a red star."}],
              "tools": [], "response": {"content": None, "tool_calls": [call]}}
    assert copy_match(sample) == (1.0, 1.0)
    sample["messages"][0]["content"] = "I need 3 images: a blue circle."
    assert copy_match(sample) == (0.0, 0.0)


def test_presence_rule_reads_the_request(tmp_path):
    """On the synthetic data the presence rule's evidence is the user's request (messages[0]): its
    AUC equals scikit-learn's over the per-sample scores, and blanking the requests takes most of
    it away; launch.synth_diagnose prints that same AUC."""
    synth.write_dataset(str(tmp_path / "d"), n=600, seed=11, fail_rate=0.3, with_tokenizer=False)
    path = tmp_path / "d" / "samples.jsonl"
    samples = [json.loads(line) for line in open(path)]
    assert all(s["messages"][0]["role"] == "user" for s in samples)
    got = read_presence_aucs(str(path))
    y = [s["label"]["l3"] == "fail" for s in samples]
    assert got["conversation"] == pytest.approx(roc_auc_score(y, [-copy_match(s)[0] for s in samples]))
    for s in samples:
        s["messages"][0]["content"] = "please help"
    blank = tmp_path / "blank.jsonl"
    blank.write_text("".join(json.dumps(s) + "\n" for s in samples))
    assert got["conversation"] > read_presence_aucs(str(blank))["conversation"] + 0.05
    out = subprocess.run([sys.executable, "-m", "launch.synth_diagnose", f"--input={path}"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"AUC conversation {got['conversation']:.3f}" in out
