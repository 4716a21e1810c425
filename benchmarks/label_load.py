"""The labeller at the field report's scale: peak memory against input size, and samples/s.

    python -m benchmarks.label_load [--n=3310 | --full] [--fractions=0.1,0.5,1] [--endpoints=3 --concurrency=2]
        [--data_dir=/tmp/rm_jax_label_bench] [--peer_src=DIR]

Input: synthetic conversations (rm_jax.data.synth) with every image inline (a JPEG data URI in
the message parts and tool results, about 13 KB a row: the report's 33,102 samples make a
~430 MB JSONL with ``--full``). It is written once per size under ``--data_dir`` and reused;
each fraction is the first rows of the full file.

Teacher: the instant stand-in (rm_jax.label.standin), a real OpenAI-compatible HTTP server on
127.0.0.1 in a process of its own, behind ``--endpoints`` base URLs (the report ran three
teacher instances). So the figures are the labeller's own cost: reading, thumbnails, requests,
writing; a real teacher's latency divides the rate, not the memory.

Each size runs ``python -m launch.label`` in a child process, with OUT in another folder than
the input (the image-path rewrite runs); its peak RSS is the child's ``ru_maxrss`` (os.wait4).
Each size is labelled, then the same command is run again: that run resumes over the complete
OUT (it scans OUT and labels nothing), and its peak RSS is the resume's. ``--peer_src=DIR`` runs
the same sizes with the labeller of another source tree (e.g. the previous commit:
``git archive <commit> | tar -x -C DIR``), side by side; ``--peer_max_rows`` skips its larger sizes.

Goal: peak RSS under 1 GiB, flat in the input size. A measurement, not a test. Last line: one
JSON object.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from absl import app, flags
from PIL import Image

from rm_jax.data import synth
from rm_jax.data.images import to_data_uri
from rm_jax.data.tool_content import parse_tool_content
from rm_jax.label import standin

FIELD_REPORT_SAMPLES = 33_102

_N = flags.DEFINE_integer("n", 3_310, "input rows of the largest size (a tenth of the report's by default)")
_FULL = flags.DEFINE_bool("full", False, f"the report's {FIELD_REPORT_SAMPLES:,} samples (~430 MB of JSONL)")
_FRACTIONS = flags.DEFINE_list("fractions", ["0.1", "0.5", "1"], "input sizes, as fractions of --n")
_ENDPOINTS = flags.DEFINE_integer("endpoints", 3, "teacher base URLs (all the one stand-in)")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 2, "requests in flight per endpoint (launch.label's default)")
_DATA_DIR = flags.DEFINE_string("data_dir", os.path.join(tempfile.gettempdir(), "rm_jax_label_bench"),
                                "where the inputs are written once and reused")
_PEER_SRC = flags.DEFINE_string("peer_src", None, "a source tree whose launch.label runs the same sizes")
_PEER_MAX_ROWS = flags.DEFINE_integer("peer_max_rows", 10**9, "run the peer only on sizes up to this many rows")
_POOL = flags.DEFINE_integer("pool", 512, "distinct synthetic conversations the input cycles through")
_IMAGE_EDGE = flags.DEFINE_integer("image_edge", 160, "long edge of the inline images, px")
_SEED = flags.DEFINE_integer("seed", 0, "synthetic data")


# ---------------------------------------------------------------- the input


def _photo_uri(rng: np.random.Generator, edge: int) -> str:
    """A photo-like JPEG (smooth colour field plus grain): compresses as photos do, not as the
    synthetic flat shapes do."""
    w, h = edge, int(edge * rng.uniform(0.6, 1.0))
    yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
    field = rng.uniform(60, 200, size=3) + 90 * np.stack([np.sin(6 * xx + c) * np.cos(4 * yy - c) for c in range(3)], -1)
    pixels = np.clip(field + rng.normal(0, 18, size=(h, w, 3)), 0, 255).astype(np.uint8)
    return to_data_uri(Image.fromarray(pixels, "RGB"), "JPEG")


def _inline(sample: dict, uris: dict[str, str], rng: np.random.Generator) -> dict:
    """Every conversation image of a synthetic sample as a data URI (one per path)."""
    def uri(path: str) -> str:
        if path not in uris:
            uris[path] = _photo_uri(rng, _IMAGE_EDGE.value)
        return uris[path]

    for m in sample["messages"]:
        if isinstance(m["content"], list):
            for p in m["content"]:
                if p.get("type") == "image":
                    p["image"] = uri(p["image"])
        elif m["role"] == "tool":
            text = m["content"]
            for path in parse_tool_content(text).images:
                text = text.replace(json.dumps(path), json.dumps(uri(path)))
            m["content"] = text
    return sample


def _write_input(path: str, n: int) -> None:
    rng = np.random.default_rng(_SEED.value)
    with tempfile.TemporaryDirectory() as tmp:
        pool = synth.generate(synth.SynthConfig(n=_POOL.value, seed=_SEED.value), tmp)
    uris: dict[str, str] = {}
    pool = [_inline(s, uris, rng) for s in pool]
    for s in pool:
        if not any(isinstance(m["content"], list) for m in s["messages"]):
            # The user's own photo, so that every row carries an image even without a tool result.
            first_user = next(m for m in s["messages"] if m["role"] == "user")
            first_user["content"] = [{"type": "image", "image": _photo_uri(rng, _IMAGE_EDGE.value)},
                                     {"type": "text", "text": first_user["content"]}]
    tmp_path = path + ".tmp"
    with open(tmp_path, "w", encoding="utf-8") as f:
        for i in range(n):
            s = dict(pool[i % len(pool)])
            s["id"], s["prompt_id"] = f"r{i}-{s['id']}", f"r{i}-{s['prompt_id']}"
            s.pop("label", None)
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    os.replace(tmp_path, path)


def _head(src: str, dst: str, n: int) -> None:
    with open(src, "rb") as f, open(dst + ".tmp", "wb") as g:
        for i, line in enumerate(f):
            if i >= n:
                break
            g.write(line)
    os.replace(dst + ".tmp", dst)


def inputs(n: int, fractions: list[float]) -> list[tuple[int, str]]:
    folder = os.path.join(_DATA_DIR.value, f"n{n}_seed{_SEED.value}_edge{_IMAGE_EDGE.value}")
    os.makedirs(folder, exist_ok=True)
    full = os.path.join(folder, "samples.jsonl")
    if not os.path.exists(full):
        t0 = time.monotonic()
        _write_input(full, n)
        print(f"wrote {full} ({os.path.getsize(full) / 2**20:.0f} MiB) in {time.monotonic() - t0:.0f} s", flush=True)
    out = []
    for frac in fractions:
        k = max(1, round(n * frac))
        path = full if k == n else os.path.join(folder, f"head{k}.jsonl")
        if not os.path.exists(path):
            _head(full, path, k)
        out.append((k, path))
    return out


# ---------------------------------------------------------------- the runs


def run_labeller(src: str, input_path: str, out: str, base_url: str) -> dict:
    """One `launch.label` run in a child process of `src`: wall time, peak RSS, its stats."""
    cmd = [sys.executable, "-m", "launch.label", f"--input={input_path}", f"--out={out}", f"--model={standin.MODEL}",
           f"--concurrency={_CONCURRENCY.value}", "--max_retries=2", "--timeout_s=60"]
    cmd += [f"--endpoint={base_url}"] * _ENDPOINTS.value
    env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    stdout = proc.stdout.read().decode()     # a few lines: it cannot fill the pipe
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {stdout[-2000:]}")
    stats = json.load(open(out + ".stats.json"))
    with open(out, "rb") as f:
        n_lines = sum(1 for _ in f)
    if not (stats["read"] == stats["labelled"] == n_lines and stats["failed"] == stats["rejected"] == 0):
        raise RuntimeError(f"not every row was labelled once: {stats} with {n_lines} lines in OUT")
    return {"rows": stats["read"], "peak_rss_mib": usage.ru_maxrss / 1024, "wall_s": wall,
            "labelled_this_run": stats["labelled_this_run"],
            "samples_per_s": stats["labelled_this_run"] / stats["elapsed_s"], "elapsed_s": stats["elapsed_s"]}


def label_then_resume(src: str, input_path: str, base_url: str) -> dict:
    """Label the input into an OUT in another folder, then run again: the rerun resumes over the
    complete OUT (it scans OUT and labels nothing)."""
    out_dir = tempfile.mkdtemp(prefix="label_load_out_")
    out = os.path.join(out_dir, "labels", "labels.jsonl")
    os.makedirs(os.path.dirname(out))
    try:
        first = run_labeller(src, input_path, out, base_url)
        again = run_labeller(src, input_path, out, base_url)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if first["labelled_this_run"] != first["rows"] or again["labelled_this_run"] != 0:
        raise RuntimeError(f"the rerun did not resume: {first} then {again}")
    return {**first, "resume_peak_rss_mib": again["peak_rss_mib"], "resume_wall_s": again["wall_s"]}


def main(argv):
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)
    n = FIELD_REPORT_SAMPLES if _FULL.value else _N.value
    fractions = sorted(float(f) for f in _FRACTIONS.value)
    sizes = inputs(n, fractions)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = _free_port()
    teacher = multiprocessing.get_context("spawn").Process(target=standin.serve_forever, args=(port,), daemon=True)
    teacher.start()
    base_url = f"http://127.0.0.1:{port}/v1"
    _wait_ready(base_url)
    rows = []
    try:
        for k, path in sizes:
            mib = os.path.getsize(path) / 2**20
            row = {"rows": k, "input_mib": round(mib, 1), "ours": label_then_resume(repo, path, base_url)}
            if _PEER_SRC.value and k <= _PEER_MAX_ROWS.value:
                row["peer"] = label_then_resume(os.path.abspath(_PEER_SRC.value), path, base_url)
            rows.append(row)
            _print_row(row)
    finally:
        teacher.terminate()
        teacher.join(10)
    ours = [r["ours"] for r in rows]
    result = {"bench": "label_load", "n": n, "endpoints": _ENDPOINTS.value, "concurrency": _CONCURRENCY.value,
              "input_mib": [r["input_mib"] for r in rows], "rows": [r["rows"] for r in rows],
              "peak_rss_mib": [round(o["peak_rss_mib"]) for o in ours],
              "resume_peak_rss_mib": [round(o["resume_peak_rss_mib"]) for o in ours],
              "peak_rss_growth_mib": round(ours[-1]["peak_rss_mib"] - ours[0]["peak_rss_mib"]),
              "samples_per_s": [round(o["samples_per_s"], 1) for o in ours],
              "goal_peak_rss_under_1gib": max(max(o["peak_rss_mib"], o["resume_peak_rss_mib"]) for o in ours) < 1024}
    if any("peer" in r for r in rows):
        peer = [r["peer"] for r in rows if "peer" in r]
        result["peer_rows"] = [r["rows"] for r in rows if "peer" in r]
        result["peer_peak_rss_mib"] = [round(p["peak_rss_mib"]) for p in peer]
        result["peer_resume_peak_rss_mib"] = [round(p["resume_peak_rss_mib"]) for p in peer]
        result["peer_samples_per_s"] = [round(p["samples_per_s"], 1) for p in peer]
    print(json.dumps(result))


def _print_row(row: dict) -> None:
    o = row["ours"]
    text = (f"{row['rows']:>7,} rows {row['input_mib']:>7.1f} MiB | streaming: peak RSS {o['peak_rss_mib']:>6.0f} MiB "
            f"(resume {o['resume_peak_rss_mib']:>5.0f}), {o['samples_per_s']:>6.1f} samples/s")
    if "peer" in row:
        p = row["peer"]
        text += (f" | peer: peak RSS {p['peak_rss_mib']:>6.0f} MiB (resume {p['resume_peak_rss_mib']:>5.0f}), "
                 f"{p['samples_per_s']:>6.1f} samples/s | peer/ours RSS {p['peak_rss_mib'] / o['peak_rss_mib']:.2f}x")
    print(text, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base_url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the stand-in teacher at {base_url} did not start")


if __name__ == "__main__":
    app.run(main)
