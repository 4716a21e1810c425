"""launch.serve on loopback: a real uvicorn server in a subprocess, real httpx / openai clients.

One random-init tiny judge workdir and one server (with a bearer key and a small queue) serve the
whole module; the SIGTERM test ends that server, so it is the last test here.
"""

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_fixtures import REPO, JudgeServer, make_judge_workdir, server_env

from rm_jax.data.schema import decode_arguments
from rm_jax.serve.toolcalls import parse_raw_response

KEY = "test-key-123"
MAX_QUEUE = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_cfg, built_shards, renderer):
    root = tmp_path_factory.mktemp("serve")
    workdir = make_judge_workdir(root, tiny_cfg, built_shards[0], renderer, steps=(1, 2), chosen=1)
    return workdir, root / "jax_cache"


@pytest.fixture(scope="module")
def server(run, synth_dir, tmp_path_factory):
    workdir, cache = run
    key_file = tmp_path_factory.mktemp("key") / "key.txt"
    key_file.write_text(KEY + "\n")
    srv = JudgeServer(workdir, "--max_batch=8", "--max_wait_ms=30", f"--max_queue={MAX_QUEUE}", "--tool_call_format=auto",
                      f"--image_root={synth_dir}", "--max_body_mb=1", f"--api_key_file={key_file}",
                      cache_dir=cache, api_key=KEY)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=300.0) as c:
        yield c


@pytest.fixture(scope="module")
def raw_samples(synth_dir):
    with open(os.path.join(synth_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    by_id = {r["id"]: r for r in rows}
    return by_id


def _with_calls(sample, calls, content):
    s = copy.deepcopy(sample)
    s["response"] = {"content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)]}
    return s


def _label(sample) -> str:
    return json.dumps({k: v for k, v in sample.items() if k != "response"})


# ---------------------------------------------------------------- no server needed


def test_raw_tool_calls_closed_unclosed_double_encoded_and_malformed():
    args = {"prompt": "a red fox", "size": "1024x1024"}
    closed = parse_raw_response('Sure.\n<tool_call>\n{"name": "generate_image", "arguments": %s}\n</tool_call><|im_end|>'
                                % json.dumps(args))
    assert closed.content == "Sure." and closed.malformed == 0
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in closed.tool_calls] == [("generate_image", args)]
    double = parse_raw_response("<tool_call>%s</tool_call>" % json.dumps(
        {"name": "generate_image", "arguments": json.dumps(json.dumps(args))}))
    assert double.content is None and double.tool_calls[0]["function"]["arguments"] == json.dumps(json.dumps(args))
    unclosed = parse_raw_response('ok <tool_call>{"name": "generate_image", "arguments": {"prompt": "a')
    assert unclosed.malformed == 1 and unclosed.content == "ok"
    assert unclosed.tool_calls[0]["function"]["name"] == ""
    broken = parse_raw_response("<tool_call>{name: generate_image}</tool_call>")
    assert broken.malformed == 1 and broken.tool_calls[0]["function"]["arguments"] == "{name: generate_image}"
    two = parse_raw_response('<tool_call>{"name":"a","arguments":{}}</tool_call>\n<tool_call>{"name":"b"}</tool_call>')
    assert [c["function"]["name"] for c in two.tool_calls] == ["a", "b"] and two.malformed == 0
    assert parse_raw_response("just text").to_json() == {"content": "just text", "tool_calls": []}


def test_non_loopback_host_without_key_refuses_to_start(run):
    workdir, _ = run
    proc = subprocess.run([sys.executable, "-m", "launch.serve", f"--workdir={workdir}", "--host=0.0.0.0",
                           "--port=1"], cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--api_key_file" in proc.stderr and "0.0.0.0" in proc.stderr


# ---------------------------------------------------------------- the server


def _listen_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on ``port`` (the kernel's view, /proc/net/tcp{,6})."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        with open(name) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if int(p, 16) == port and state == "0A":
                    found.add(addr)
    return found


def test_health_models_bind_default_and_auth(server, http):
    health = httpx.get(server.url + "/healthz").json()     # open: load balancers probe without a key
    assert health == {"status": "ok", "step": 1, "model_type": "qwen3_vl_moe", "queue": 0}   # the sweep's step
    assert _listen_addresses(server.port) == {"0100007F"}     # 127.0.0.1, nothing else
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [server.model_id]
    assert server.model_id.endswith("step1")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and "bearer" in r.json()["detail"]
    assert httpx.post(server.url + "/v1/score", json={"samples": []}).status_code == 401


@pytest.mark.slow
def test_score_rows_equal_launch_score(server, http, raw_samples, synth_dir, run, tmp_path):
    workdir, cache = run
    # A GRPO group with images (shared prefix), a tool-call group, one text-only sample.
    ids = ["p2-s0", "p2-s1", "p2-s2", "p5-s0", "p5-s1", "p0-s0"]
    samples = [raw_samples[i] for i in ids]
    src = os.path.join(synth_dir, f"serve_eq_{tmp_path.name}.jsonl")     # beside images/: same paths
    with open(src, "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    out = tmp_path / "scores.jsonl"
    subprocess.run([sys.executable, "-m", "launch.score", f"--workdir={workdir}", f"--input={src}", f"--out={out}",
                    "--batch_size=8"], cwd=REPO, env=server_env(cache), check=True, capture_output=True, timeout=600)
    expected = [json.loads(line) for line in out.read_text().splitlines()]

    outside = copy.deepcopy(raw_samples["p1-s0"])
    outside["id"] = "outside"
    for m in outside["messages"]:
        for p in m["content"] if isinstance(m["content"], list) else []:
            if p.get("type") == "image":
                p["image"] = "../" * 8 + "etc/passwd.png"
    no_response = {k: v for k, v in raw_samples["p3-s0"].items() if k != "response"}
    r = http.post("/v1/score", json={"samples": samples[:3] + [outside, no_response] + samples[3:], "mode": "full"})
    assert r.status_code == 200
    rows = r.json()["results"]
    assert [row["id"] for row in rows] == ids[:3] + ["outside", "p3-s0"] + ids[3:]
    bad = rows[3:5]
    rows = rows[:3] + rows[5:]
    assert bad[0]["error"].startswith("image_path_refused") and "outside --image_root" in bad[0]["error"]
    assert bad[1]["error"].startswith("missing_field") and "response" in bad[1]["error"] and len(bad[1]) == 2
    for got, want in zip(rows, expected):
        assert set(got) == set(want)
        assert abs(got["p_pass"] - want["p_pass"]) < 1e-5 and abs(got["reward"] - want["reward"]) < 1e-5
        same = {k for k in want if k not in ("p_pass", "reward", "off_vocab_mass", "components")}
        assert {k: got[k] for k in same} == {k: want[k] for k in same}
        assert {k: v for k, v in got["components"].items() if k != "p_pass_term"} == \
               {k: v for k, v in want["components"].items() if k != "p_pass_term"}

    fast = http.post("/v1/score", json={"samples": samples, "mode": "p_pass"}).json()["results"]
    for got, want in zip(fast, expected):
        assert abs(got["p_pass"] - want["p_pass"]) < 1e-5
        assert got["components"]["judge_terms"] == "p_pass_only" and got["reason"] is None
        assert got["components"]["issues_term"] == 0 and got["components"]["img_term"] == 0
        assert abs(got["reward"] - (got["rule_score"] + 2 * got["p_pass"] - 1)) < 1e-9 or got["components"]["gated"]


def test_get_reward_parses_raw_text_and_gates_what_it_cannot_score(server, http, raw_samples):
    base = raw_samples["p5-s0"]
    call = base["response"]["tool_calls"][0]["function"]
    name = call["name"]
    args = call["arguments"] if isinstance(call["arguments"], dict) else json.loads(call["arguments"])
    block = lambda a: "<tool_call>\n" + json.dumps({"name": name, "arguments": a}) + "\n</tool_call>"
    prompt = "<|im_start|>user\nrecolor it<|im_end|>\n<|im_start|>assistant\n"
    queries = [prompt + "On it.\n" + block(args) + "<|im_end|>",                      # closed
               prompt + "On it.\n" + block(json.dumps(json.dumps(args))),            # arguments encoded twice
               prompt + "On it.\n<tool_call>\n{\"name\": \"%s\", \"arguments\": {\"a\": 1" % name,   # unclosed
               prompt + "<tool_call>{not json}</tool_call>",                        # undecodable
               prompt + "anything",                                                  # label is not JSON
               "a different prompt" + "anything"]                                    # no assistant turn
    labels = [_label(base)] * 4 + ["{not json", _label(base)]
    r = http.post("/get_reward", json={"query": queries, "prompts": [prompt] * len(queries), "labels": labels})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"rewards", "scores", "extra_logs", "errors"}
    logs = body["extra_logs"]
    assert set(logs) == {"p_pass", "rule_score", "n_issues", "img", "gated", "error"}
    assert all(len(v) == len(queries) for v in logs.values())
    # scores: P(pass), a pass rate in [0, 1] (OpenRLHF's filter); 0 where the gate applies
    assert body["scores"][:2] == logs["p_pass"][:2] and all(0.0 <= x <= 1.0 for x in body["scores"])
    assert body["scores"][2:] == [0.0] * 4

    structured = _with_calls(base, [(name, args)], "On it.")
    ref = http.post("/v1/score", json={"samples": [structured]}).json()["results"][0]
    assert abs(body["rewards"][0] - ref["reward"]) < 1e-5 and abs(logs["p_pass"][0] - ref["p_pass"]) < 1e-5
    assert abs(body["rewards"][1] - ref["reward"]) < 1e-5          # decoded to the same call
    assert logs["gated"][:2] == [0.0, 0.0] and logs["error"][:2] == [0.0, 0.0] and body["errors"][:2] == [None, None]
    for i in (2, 3):                                                 # malformed calls: the gate, judge ignored
        assert body["rewards"][i] == -2.0 and logs["gated"][i] == 1.0 and logs["error"][i] == 0.0
    assert body["rewards"][4] == -2.0 and logs["error"][4] == 1.0 and body["errors"][4].startswith("labels[4]")
    assert body["rewards"][5] == -2.0 and "no assistant-turn start" in body["errors"][5]

    empty = http.post("/get_reward", json={"query": [], "prompts": [], "labels": []}).json()
    assert empty["rewards"] == [] and empty["scores"] == [] and all(v == [] for v in empty["extra_logs"].values())
    mismatch = http.post("/get_reward", json={"query": ["a"], "prompts": [], "labels": []})
    assert mismatch.status_code == 422 and "prompts" in mismatch.text


def _xml_block(name: str, args: dict) -> str:
    """A call as the Qwen3.5 / Qwen3-Coder templates write it."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_get_reward_finds_the_response_by_the_assistant_turn_in_real_query_shapes(server, http, raw_samples, renderer):
    """The query's prompt part differs from ``prompts[i]`` as OpenRLHF builds it (image pads
    expanded, left-truncated, a system prompt added), Qwen3.5 XML calls and thinking; slime's body."""
    base = raw_samples["p2-s0"]                                  # a sample with images
    call = base["response"]["tool_calls"][0]["function"]
    args = decode_arguments(call["arguments"])[0]
    label = _label(base)
    ref = http.post("/v1/score", json={"samples": [_with_calls(base, [(call["name"], args)], None)]}).json()
    ref = ref["results"][0]
    tok = renderer.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "edit it"}]}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.count("<|image_pad|>") == 1
    expanded = prompt.replace("<|image_pad|>", "<|image_pad|>" * 64)       # what the processor's ids decode to
    with_system = "<|im_start|>system\nYou are helpful.<|im_end|>\n" + prompt
    response_hermes = "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": args}) + "\n</tool_call>"
    response_xml = "<think>\nthe user wants an edit\n</think>\n\n" + _xml_block(call["name"], args)
    # OpenRLHF decodes prompt + response ids with skip_special_tokens=False: the stop token stays
    queries = [expanded + response_hermes + "<|im_end|>", prompt[len(prompt) // 2:] + response_hermes,
               with_system + response_xml + "<|im_end|><|endoftext|>", expanded + response_xml[:-12]]
    body = http.post("/get_reward", json={"query": queries, "prompts": [prompt] * 4, "labels": [label] * 4}).json()
    assert body["errors"][:3] == [None] * 3
    for i in range(3):
        assert abs(body["rewards"][i] - ref["reward"]) < 1e-5 and abs(body["scores"][i] - ref["p_pass"]) < 1e-5
    assert body["rewards"][3] == -2.0 and body["extra_logs"]["gated"][3] == 1.0      # the call never closed

    slime = http.post("/get_reward", json={"prompt": prompt, "response": response_xml, "label": json.loads(label)})
    assert slime.status_code == 200
    got = slime.json()
    assert abs(got["reward"] - ref["reward"]) < 1e-5 and abs(got["score"] - ref["p_pass"]) < 1e-5
    assert got["error"] is None and got["gated"] == 0.0
    bad = http.post("/get_reward", json={"prompt": "", "response": "hi", "label": "{nope"}).json()
    assert bad["reward"] == -2.0 and bad["error"].startswith("label")
    assert http.post("/get_reward", json={"prompt": "x"}).status_code == 422


@pytest.mark.slow
def test_chat_completions_through_the_openai_sdk(server):
    import base64
    import io

    from openai import AsyncOpenAI, BadRequestError, NotFoundError
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (40, 24), (200, 30, 30)).save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    async def go():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == [server.model_id]
        messages = [{"role": "system", "content": "You judge."},
                    {"role": "user", "content": [{"type": "text", "text": "What colour?"},
                                                 {"type": "image_url", "image_url": {"url": uri}}]}]
        kw = dict(model=server.model_id, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        a, b = await asyncio.gather(client.chat.completions.create(**kw), client.chat.completions.create(**kw))
        assert a.choices[0].message.content == b.choices[0].message.content       # greedy: deterministic
        lp = a.choices[0].logprobs.content
        assert len(lp) == a.usage.completion_tokens <= 6 and a.usage.prompt_tokens > 0
        assert a.choices[0].finish_reason in ("stop", "length")
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)
        # greedy picks the most likely token: its logprob is the top alternative's
        assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in lp)
        sampled = await client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=6,
                                                       temperature=1.0, seed=3)
        assert sampled.choices[0].logprobs is None and sampled.usage.completion_tokens <= 6
        with pytest.raises(NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=4)
        with pytest.raises(BadRequestError, match="data:image"):
            await client.chat.completions.create(model=server.model_id, max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
        await client.close()
    asyncio.run(go())


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, http, raw_samples):
    malformed = http.post("/v1/score", content=b"{not json", headers={"Content-Type": "application/json"})
    assert malformed.status_code == 422 and "json" in malformed.text.lower()
    missing = http.post("/v1/score", json={"mode": "full"})
    assert missing.status_code == 422 and "samples" in missing.text
    bad_mode = http.post("/v1/score", json={"samples": [], "mode": "fast"})
    assert bad_mode.status_code == 422 and "mode" in bad_mode.text
    huge = http.post("/v1/score", json={"samples": [{"id": "x", "pad": "a" * (2 << 20)}]})
    assert huge.status_code == 413 and "limit" in huge.text
    too_many = http.post("/v1/score", json={"samples": [raw_samples["p0-s0"]] * (MAX_QUEUE + 1)})
    assert too_many.status_code == 413 and "max_queue" in too_many.text
    assert http.post("/v1/score", json={"samples": []}).json() == {"results": []}
    # NaN / Infinity literals parse in Python; the 422 that echoes them must still be JSON
    for path, body in (("/v1/score", b'{"samples": [], "mode": NaN}'),
                       ("/get_reward", b'{"query": [Infinity], "prompts": ["a"], "labels": ["{}"]}'),
                       ("/v1/chat/completions", b'{"model": "m", "messages": [], "temperature": NaN}')):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["detail"], (path, r.text)
    assert http.get("/healthz").json()["status"] == "ok"


def _poll_queue(server, at_least: int, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while httpx.get(server.url + "/healthz").json()["queue"] < at_least:
        assert time.time() < deadline, "the request never reached the queue"
        time.sleep(0.005)


@pytest.mark.slow
def test_concurrent_requests_share_batches_and_a_disconnect_breaks_nothing(server, http, raw_samples):
    ids = ["p3-s0", "p3-s1", "p3-s2", "p4-s0", "p4-s1", "p6-s0"]
    alone = {row["id"]: row for row in
             http.post("/v1/score", json={"samples": [raw_samples[i] for i in ids], "mode": "p_pass"}).json()["results"]}

    def batches():
        text = http.get("/metrics").text
        line = next(l for l in text.splitlines() if l.startswith('rm_jax_batch_size_count{kind="score_p_pass"}'))
        return float(line.split()[-1])
    before = batches()

    async def go():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300.0) as c:
            # one client gives up at once: its request is in the same batch as the others
            async def impatient():
                with pytest.raises(httpx.TimeoutException):
                    await c.post("/v1/score", json={"samples": [raw_samples["p6-s1"]], "mode": "p_pass"},
                                 timeout=httpx.Timeout(0.02))
            calls = [c.post("/v1/score", json={"samples": [raw_samples[i]], "mode": "p_pass"}) for i in ids]
            got = await asyncio.gather(impatient(), *calls)
            return [r.json()["results"][0] for r in got[1:]]
    rows = asyncio.run(go())
    for row in rows:
        assert abs(row["p_pass"] - alone[row["id"]]["p_pass"]) < 1e-5
    # 7 requests in far fewer device batches: the worker coalesced them
    assert batches() - before <= 3
    deadline = time.time() + 60
    while http.get("/healthz").json()["queue"] != 0:       # the abandoned job finished too
        assert time.time() < deadline
        time.sleep(0.05)


@pytest.mark.slow
def test_full_queue_answers_503_with_retry_after(server, http, raw_samples):
    big = [raw_samples[f"p{k}-s{j}"] for k in range(7, 13) for j in range(3)][:MAX_QUEUE]
    result = {}
    t = threading.Thread(target=lambda: result.update(r=http.post("/v1/score", json={"samples": big})))
    t.start()
    _poll_queue(server, MAX_QUEUE)
    r = http.post("/v1/score", json={"samples": [raw_samples["p0-s0"]]})
    t.join()
    # Retry-After: seconds for the measured drain rate to make room (whole seconds, 1..60)
    assert r.status_code == 503 and 1 <= int(r.headers["Retry-After"]) <= 60 and "queue full" in r.text
    assert result["r"].status_code == 200 and len(result["r"].json()["results"]) == MAX_QUEUE
    assert http.post("/v1/score", json={"samples": [raw_samples["p0-s0"]], "mode": "p_pass"}).status_code == 200


def test_metrics_count_requests_latency_batches_and_queue(server, http, raw_samples):
    # its own requests of each kind: under xdist the module's other tests may run on another worker
    assert http.post("/v1/score", json={"samples": [{"id": "x", "pad": "a" * (2 << 20)}]}).status_code == 413
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert http.post("/get_reward", json={"query": [], "prompts": [], "labels": []}).status_code == 200
    assert http.post("/v1/score", json={"samples": [raw_samples["p0-s0"]], "mode": "full"}).status_code == 200
    text = http.get("/metrics").text
    for needle in ('rm_jax_requests_total{endpoint="/v1/score",status="200"}',
                   'rm_jax_requests_total{endpoint="/v1/score",status="413"}',
                   'rm_jax_requests_total{endpoint="/v1/models",status="401"}',
                   'rm_jax_request_latency_seconds_bucket{endpoint="/get_reward",le="0.5"}',
                   'rm_jax_batch_size_bucket{kind="score_full",le="8.0"}', "rm_jax_queue_depth 0.0"):
        assert needle in text, needle


@pytest.mark.slow
def test_clients_verl_trl_openrlhf(server, http, raw_samples):
    from rm_jax.rl import openrlhf_reward, trl_reward, verl_reward
    base = raw_samples["p5-s0"]
    call = base["response"]["tool_calls"][0]["function"]
    text = "Done.\n<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "\n</tool_call>"
    label = _label(base)
    ref = http.post("/get_reward", json={"query": [text, "<tool_call>{"], "prompts": ["", ""],
                                         "labels": [label, label]}).json()

    async def verl_calls():
        return await asyncio.gather(
            verl_reward.compute_score("tool_agent", text, label, {}, url=server.url, api_key=KEY),
            verl_reward.compute_score("tool_agent", "<tool_call>{", "", {"sample": json.loads(label)},
                                      url=server.url, api_key=KEY))
    good, gated = asyncio.run(verl_calls())
    assert set(good) == {"score", "p_pass", "rule_score", "n_issues", "img", "gated"}
    assert abs(good["score"] - ref["rewards"][0]) < 1e-5 and good["gated"] == 0.0
    assert gated["score"] == -2.0 and gated["gated"] == 1.0

    reward = trl_reward.JudgeReward(server.url, api_key=KEY)
    conversational = [{"role": "assistant", "content": "Done.", "tool_calls": [
        {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}]
    got = reward(prompts=["p"] * 3, completions=[text, conversational, "x"], sample=[label, label, None])
    assert got[2] is None and reward.__name__ == "rm_jax_judge"
    assert abs(got[0] - ref["rewards"][0]) < 1e-5 and abs(got[1] - ref["rewards"][0]) < 1e-5
    assert openrlhf_reward.remote_url_flag() == ["--reward.remote_url", "http://127.0.0.1:8000/get_reward"]


def test_sigterm_drains_requests_in_flight_then_exits(server, http, raw_samples):
    """Last: it ends the module's server."""
    # p_pass of samples in no group: a device call not compiled yet, so it is surely in flight
    samples = [raw_samples[f"p{k}-s0"] for k in (11, 12, 13, 14)]
    result = {}
    t = threading.Thread(target=lambda: result.update(r=http.post("/v1/score", json={"samples": samples,
                                                                                    "mode": "p_pass"})))
    t.start()
    _poll_queue(server, len(samples))
    server.proc.send_signal(signal.SIGTERM)
    t.join()
    assert result["r"].status_code == 200
    assert [row["id"] for row in result["r"].json()["results"]] == [s["id"] for s in samples]
    assert all("p_pass" in row for row in result["r"].json()["results"])
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/healthz", timeout=2.0)
