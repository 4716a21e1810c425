"""An instant OpenAI-compatible stand-in teacher: a dry run of a labelling job without a model.

It answers every ``POST /v1/chat/completions`` at once with a verdict JSON that a hash of the
request picks (``fail`` for about ``fail_share`` of the requests; the same request always gets
the same verdict, so a resumed run agrees with an uninterrupted one), and ``GET /v1/models``
with its one model. It reads no image and judges nothing: it rehearses paths, outputs, resume
and the labeller's own throughput and memory (benchmarks/label_load.py), on loopback.

    with StandinTeacher() as teacher:          # uvicorn in a thread, 127.0.0.1, a free port
        label_file(..., LabelSettings(endpoints=(teacher.base_url,), model=teacher.model, ...))

``serve_forever(port)`` runs it in a process of its own (the benchmark measures the labeller's
memory alone).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time

import fastapi
import uvicorn
from fastapi.responses import JSONResponse

MODEL = "standin-teacher"


def _reply_text(digest: bytes, fail_share: float) -> str:
    fail = int.from_bytes(digest[:4], "big") < fail_share * 2 ** 32
    img = digest[4] % 11
    if fail:
        return json.dumps({"l3": "fail", "reason": "stand-in verdict", "issues": ["standin"], "img": img})
    return json.dumps({"l3": "pass", "reason": "stand-in verdict", "issues": [], "img": img})


def make_app(model: str = MODEL, fail_share: float = 0.25) -> fastapi.FastAPI:
    app = fastapi.FastAPI()
    app.state.requests = 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "rm_jax"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request):
        body = await request.body()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return JSONResponse({"error": {"message": f"body is not JSON: {e}"}}, status_code=400)
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or obj.get("model") != model:
            return JSONResponse({"error": {"message": f"expected a chat request for model {model!r}"}},
                                status_code=400)
        app.state.requests += 1
        digest = hashlib.sha256(json.dumps(obj["messages"], sort_keys=True).encode()).digest()
        return {"id": "chatcmpl-" + digest[:8].hex(), "object": "chat.completion", "created": int(time.time()),
                "model": model,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": _reply_text(digest, fail_share)}}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}

    return app


def _bound_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


class StandinTeacher:
    """The stand-in served by uvicorn in a daemon thread of this process."""

    def __init__(self, model: str = MODEL, fail_share: float = 0.25, port: int = 0):
        self.model = model
        self.app = make_app(model, fail_share)
        self._sock = _bound_socket(port)
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def requests(self) -> int:
        return self.app.state.requests

    def __enter__(self) -> "StandinTeacher":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the stand-in teacher did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def serve_forever(port: int, model: str = MODEL, fail_share: float = 0.25) -> None:
    """Serve on 127.0.0.1:port in this process until it is terminated."""
    uvicorn.Server(uvicorn.Config(make_app(model, fail_share), log_level="warning", access_log=False)).run(
        sockets=[_bound_socket(port)])
