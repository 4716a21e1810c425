"""A real judge server on loopback, for any test that needs one (serving, labelling's teacher).

    from serve_fixtures import make_judge_workdir, JudgeServer

    workdir = make_judge_workdir(tmp_dir, tiny_cfg, built_shards[0], renderer)   # random init, 2 layers
    with JudgeServer(workdir, cache_dir=tmp_dir / "jax_cache") as server:
        server.url          # http://127.0.0.1:PORT
        server.model_id     # the `model` /v1/chat/completions expects (GET /v1/models)
        AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")

``make_judge_workdir`` writes what ``launch.train`` leaves behind and ``launch.serve`` reads: a
``manifest.json`` with the run config (data dir -> the built shards, whose manifest names the
tokenizer), Orbax checkpoints of a randomly initialized judge (shallow: compile time is most of
these tests' cost) and a ``sweep.json`` choosing one step. ``JudgeServer`` runs
``python -m launch.serve`` in a subprocess on a free port with one CPU device (``--nowarmup``
unless ``warmup=True``), waits for ``/healthz`` to report ready, and on exit sends SIGTERM and waits for the process to end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from loopback import REPO, free_port

SMALL_MODEL = dict(num_hidden_layers=2, vision_depth=1)


def make_judge_workdir(root, tiny_cfg, shards_dir: str, renderer, *, steps=(1,), chosen: int | None = None,
                       seed: int = 0) -> str:
    """A training workdir holding random-init checkpoints at ``steps`` (and sweep.json choosing
    ``chosen``, default the first). Returns its path."""
    import jax.numpy as jnp
    from flax import nnx

    from rm_jax.model import init_model
    from rm_jax.train.checkpoint import CheckpointOptions, Checkpointer
    from rm_jax.run_config import model_config, parse
    from rm_jax.train.step import TrainState

    workdir = os.path.join(str(root), "judge_run")
    os.makedirs(workdir, exist_ok=True)
    cfg = tiny_cfg.copy_and_resolve_references()
    cfg.data.dir = shards_dir
    cfg.model.text_config.vocab_size = len(renderer.tokenizer)
    cfg.model.text_config.num_hidden_layers = SMALL_MODEL["num_hidden_layers"]
    cfg.model.vision_config.depth = SMALL_MODEL["vision_depth"]
    cfg.model.vision_config.deepstack_visual_indexes = (0,)
    with open(os.path.join(workdir, "manifest.json"), "w") as f:
        json.dump({"config": cfg.to_dict(), "data_dir": os.path.abspath(shards_dir)}, f)
    ck = Checkpointer(os.path.join(workdir, "checkpoints"), CheckpointOptions(async_save=False))
    for k, step in enumerate(steps):
        model = init_model(model_config(parse(cfg)), seed=seed + k)
        ck.save(int(step), TrainState(step=jnp.asarray(int(step)), params=nnx.state(model, nnx.Param), opt_state={}),
                {})
    ck.close()
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
        json.dump({"chosen": {"step": int(steps[0] if chosen is None else chosen)}}, f)
    return workdir


def small_scorer(tiny_cfg, renderer, *, batch_size: int, max_new_tokens: int = 8, seed: int = 0):
    """A random-init shallow judge's Scorer with the tiny run's buckets and image budget."""
    from rm_jax.model import init_model
    from rm_jax.run_config import model_config, parse
    from rm_jax.score.scorer import Scorer
    cfg = tiny_cfg.copy_and_resolve_references()
    cfg.model.text_config.vocab_size = len(renderer.tokenizer)
    cfg.model.text_config.num_hidden_layers = SMALL_MODEL["num_hidden_layers"]
    cfg.model.vision_config.depth = SMALL_MODEL["vision_depth"]
    cfg.model.vision_config.deepstack_visual_indexes = (0,)
    model = init_model(model_config(parse(cfg)), seed=seed)
    return Scorer.for_run(model, renderer, cfg, batch_size=batch_size, max_new_tokens=max_new_tokens, progress=False)


def server_env(cache_dir=None) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)              # one CPU device, as a single-host server has
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cache_dir is not None:               # servers and launch.score of one module compile once
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


class JudgeServer:
    """``python -m launch.serve`` on a free loopback port (see the module docstring)."""

    def __init__(self, workdir: str, *flags: str, cache_dir=None, api_key: str | None = None,
                 startup_timeout_s: float = 300.0, log_path: str | None = None, warmup: bool = False):
        # Without warmup the server skips compiling its shape ladder (tests reach few shapes).
        self.workdir, self.api_key = workdir, api_key
        self.flags = list(flags) + ([] if warmup or "--nowarmup" in flags else ["--nowarmup"])
        self.cache_dir, self.startup_timeout_s = cache_dir, startup_timeout_s
        self.log_path = log_path or os.path.join(workdir, f"serve_{os.getpid()}_{time.time_ns()}.log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.model_id: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start_process(self) -> None:
        """Launch the server and return at once (``start`` also waits for ready)."""
        cmd = [sys.executable, "-m", "launch.serve", f"--workdir={self.workdir}", f"--port={self.port}", *self.flags]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(self.cache_dir), stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def start(self) -> "JudgeServer":
        self.start_process()
        deadline = time.time() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch.serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise TimeoutError(f"launch.serve did not answer /healthz in {self.startup_timeout_s}s:\n"
                                   f"{self.log()[-4000:]}")
            time.sleep(0.2)
        models = httpx.get(self.url + "/v1/models", headers=self.headers, timeout=10.0).json()
        self.model_id = models["data"][0]["id"]
        return self

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then wait (the server drains); SIGKILL only if it does not end in time."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "JudgeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
