"""Serve a trained judge over HTTP for RL: scoring, OpenRLHF's get_reward, OpenAI chat.

  python -m launch.serve --workdir=W [--step=N] [--host=127.0.0.1] [--port=8000] [--max_batch=32]
                         [--max_wait_ms=10] [--max_queue=1024] [--image_root=DIR] [--api_key_file=F]
                         [--tool_call_format=template] [--keep_think] [--nowarmup] [--compile_cache_dir=D]

Endpoints (docs/contracts.md): GET /healthz, POST /v1/score, POST /get_reward, POST /v1/chat/completions,
GET /v1/models, GET /metrics. Without --step the sweep's chosen step is used (else the latest).
--calibration=prior|temperature maps P(pass) before the reward reads it (default none: unchanged).
It binds loopback by default; any other --host needs --api_key_file (clients then send
"Authorization: Bearer <key>"). SIGTERM stops accepting connections, answers the requests in
flight, then exits.
"""

from __future__ import annotations

import ipaddress
import os
import sys

from absl import app, flags, logging

from launch.common import define_reward_flags, quiet_library_info

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the sweep's choice, else latest)")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "bind address; non-loopback needs --api_key_file")
_PORT = flags.DEFINE_integer("port", 8000, "bind port")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 32, "samples per device batch (the scorer's batch size)")
_MAX_WAIT = flags.DEFINE_float("max_wait_ms", 10.0, "how long a batch waits for more requests after its first")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 1024, "samples admitted and not yet answered; beyond: 503")
_IMAGE_ROOT = flags.DEFINE_string("image_root", None, "folder that image paths in requests are relative to")
_API_KEY_FILE = flags.DEFINE_string("api_key_file", None, "file holding the bearer token clients must send")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer dir (default: the one the training data used)")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "decoding budget after the verdict (as launch.score)")
_MAX_BODY = flags.DEFINE_integer("max_body_mb", 64, "largest request body in MiB; beyond: 413")
_CALL_FORMAT = flags.DEFINE_enum("tool_call_format", "template", ["template", "auto", "hermes", "xml"],
                                  "how rollouts write tool calls: as the served chat template names (else detected "
                                  "per response), detected per response, Hermes JSON, or Qwen3.5/Qwen3-Coder XML")
_KEEP_THINK = flags.DEFINE_bool("keep_think", False, "judge a rollout's <think>...</think> text as part of its "
                                "content (default: reasoning is not judged)")
_WARMUP = flags.DEFINE_bool("warmup", True, "compile every scoring shape (length buckets x image rungs x p_pass/full, "
                            "shared-prefix widths) before /healthz reports ready")
_COMPILE_CACHE = flags.DEFINE_string("compile_cache_dir", None, "persistent XLA compilation cache: a restart "
                                     "reads the ladder's compiles back instead of compiling again")
_CALIBRATION = flags.DEFINE_enum("calibration", "none", ["none", "prior", "temperature"],
                                 "P(pass) calibration: none (the field report's reward), prior (undo the training "
                                 "stream's failure oversampling), temperature (fitted by launch.sweep)")
_REWARD = define_reward_flags()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_api_key(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path) as f:
        key = f.read().strip()
    if not key:
        raise ValueError(f"--api_key_file={path} is empty")
    return key


def main(argv):
    del argv
    host = _HOST.value
    if not is_loopback(host) and not _API_KEY_FILE.value:
        sys.exit(f"refusing to serve on --host={host} without --api_key_file: a non-loopback address is reachable "
                 f"from other machines, and the judge would answer anyone. Pass --api_key_file=F (a bearer token) "
                 f"or bind 127.0.0.1.")
    api_key = read_api_key(_API_KEY_FILE.value)
    if _IMAGE_ROOT.value and not os.path.isdir(_IMAGE_ROOT.value):
        sys.exit(f"--image_root={_IMAGE_ROOT.value}: no such directory")
    quiet_library_info()
    if _COMPILE_CACHE.value:
        import jax
        jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    import uvicorn

    from rm_jax.serve.app import ServeSettings, create_app
    from rm_jax.score.calibration_files import load_calibration
    from rm_jax.serve.engine import Engine
    from rm_jax.serve.toolcalls import CallFormat

    engine = Engine.load(_WORKDIR.value, _STEP.value, max_batch=_MAX_BATCH.value, max_new_tokens=_MAX_NEW.value,
                         tokenizer=_TOKENIZER.value, reward=_REWARD(),
                         calibration=load_calibration(_WORKDIR.value, _CALIBRATION.value),
                         call_format=None if _CALL_FORMAT.value == "template" else CallFormat(_CALL_FORMAT.value))
    settings = ServeSettings(max_batch=_MAX_BATCH.value, max_wait_ms=_MAX_WAIT.value, max_queue=_MAX_QUEUE.value,
                             image_root=_IMAGE_ROOT.value, api_key=api_key, max_body_bytes=_MAX_BODY.value << 20,
                             keep_think=_KEEP_THINK.value, warmup=_WARMUP.value)
    asgi, _ = create_app(engine, settings)
    logging.info("rollouts: assistant turn starts at %r, tool calls %s%s", engine.assistant_start,
                 engine.call_format.value, ", <think> judged" if _KEEP_THINK.value else "")
    logging.info("serving %s (step %d, %s) on http://%s:%d%s", engine.model_id, engine.step, engine.model_type, host,
                 _PORT.value, " with a bearer key" if api_key else "")
    # uvicorn handles SIGTERM/SIGINT: stop accepting, wait for in-flight requests, run the
    # lifespan shutdown (which drains the device worker).
    config = uvicorn.Config(asgi, host=host, port=_PORT.value, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=None)
    _drained_server_class()(config).run()
    logging.info("drained and stopped")


def _drained_server_class():
    import contextlib

    import uvicorn

    class DrainedServer(uvicorn.Server):
        """uvicorn re-raises a caught SIGTERM after its graceful shutdown, so the process would
        die by the signal; here a drained shutdown is a normal exit (status 0)."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()
    return DrainedServer


if __name__ == "__main__":
    app.run(main)
