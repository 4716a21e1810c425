"""The judge on loopback, shared by the serving benchmarks (serve_load, serve_burst, serve_ready).

* ``free_port()``: a free TCP port on 127.0.0.1 (for an in-process server or ``launch.serve``).
* ``tiny_engine(...)``: synthetic samples and their tokenizer written to a folder, and the tiny
  config's judge (random init, seed 0) behind the serving ``Engine``.
* ``ServerThread.start(asgi)``: the real app under uvicorn on 127.0.0.1 in a daemon thread of this
  process; ``stop()`` asks it to exit and joins it.

It imports jax (through the engine) but initialises no backend: a caller that serves in process
sets ``JAX_PLATFORMS`` before importing it; serve_ready's server is a child that owns the device.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import uvicorn

from configs.tiny import get_config
from rm_jax.data import synth
from rm_jax.data.render import Renderer
from rm_jax.model import init_model
from rm_jax.run_config import model_config, parse
from rm_jax.score.reward import RewardSettings
from rm_jax.serve.engine import Engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_engine(workdir: str, data_dir: str, n_samples: int, *, max_batch: int, max_new_tokens: int) -> Engine:
    """``n_samples`` synthetic samples (samples.jsonl, images, tokenizer/) written to ``data_dir``,
    and the tiny config's judge, random weights (seed 0), served from ``workdir``."""
    synth.write_dataset(data_dir, n=n_samples, seed=0)
    cfg = get_config()
    renderer = Renderer.from_config(cfg.data, os.path.join(data_dir, "tokenizer"))
    cfg.model.text_config.vocab_size = len(renderer.tokenizer)
    run = parse(cfg)
    model = init_model(model_config(run), seed=0)
    return Engine(model=model, renderer=renderer, run_cfg=run, step=0, workdir=workdir, max_batch=max_batch,
                  max_new_tokens=max_new_tokens, reward=RewardSettings())


@dataclasses.dataclass
class ServerThread:
    """An ASGI app under uvicorn on 127.0.0.1 in a daemon thread of this process."""
    server: uvicorn.Server
    thread: threading.Thread
    url: str                     # http://127.0.0.1:PORT

    @classmethod
    def start(cls, asgi) -> "ServerThread":
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        return cls(server, thread, f"http://127.0.0.1:{port}")

    def wait_listening(self) -> None:
        """Until uvicorn accepts connections (the app may still answer 503 while it warms up)."""
        while not self.server.started:
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
