"""The FastAPI app: routes of docs/contracts.md ("HTTP API") over one ``Engine`` and its ``Batcher``.

* ``GET /healthz``, ``GET /v1/models``, ``POST /v1/chat/completions`` (OpenAI-compatible),
  ``POST /v1/score`` (launch.score rows), ``POST /get_reward`` (OpenRLHF), ``GET /metrics``.
* **Bad input is the client's**: a body that does not parse or match the request model gets 422
  with the failing field (FastAPI's validation; a ``NaN``/``Infinity`` literal it echoes is sent
  as a string), an oversized body 413, a chat prompt the model
  cannot take 400; a bad *sample* inside a valid request is that sample's ``{id, error}`` row (and
  on ``/get_reward`` the gate reward), never a failed request.
* **Guard middleware** (plain ASGI, outermost): the bearer key (every route but ``/healthz``,
  which load balancers probe without credentials), the body-size limit, and the request metrics
  -- so refused requests are counted too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import math
import os
import threading
import time
import uuid

from absl import logging
from fastapi import FastAPI, HTTPException
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rm_jax.serve import api
from rm_jax.serve.batcher import Batcher, JobTooLarge, QueueFull, ShuttingDown
from rm_jax.score.scorer import ScoreMode
from rm_jax.serve.engine import KIND_CHAT, ChatInputError, kind_label
from rm_jax.serve.inputs import BadSample, parse_request_sample
from rm_jax.serve.map_budget import MapBudget
from rm_jax.serve.metrics import ServerMetrics
from rm_jax.serve.rollout import RolloutParser
from rm_jax.serve.warmup import CompileCounter, log_progress, shape_ladder, warm_ladder

ROUTES = ("/healthz", "/v1/models", "/v1/chat/completions", "/v1/score", "/get_reward", "/metrics")
OPEN_ROUTES = ("/healthz",)


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    max_batch: int = 32
    max_wait_ms: float = 10.0
    max_queue: int = 1024
    image_root: str | None = None
    keep_think: bool = False        # judge the policy's <think> text as part of its content
    warmup: bool = True             # compile the shape ladder before reporting ready
    api_key: str | None = None
    max_body_bytes: int = 64 << 20


class _Guard:
    """Auth, body limit and metrics around the whole app (see the module docstring)."""

    def __init__(self, app, settings: ServeSettings, metrics: ServerMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ROUTES else "other"
        start, status = time.perf_counter(), [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._authorize(scope, path)
            if refusal is None:
                body, refusal = await self._read_body(scope, receive)
            if refusal is not None:
                await refusal(scope, receive, send_counted)
                return
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()          # afterwards: disconnect notices, as usual
            await self.app(scope, replay, send_counted)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    def _authorize(self, scope, path):
        key = self.settings.api_key
        if key is None or path in OPEN_ROUTES:
            return None
        headers = dict(scope.get("headers") or [])
        got = headers.get(b"authorization", b"").decode("latin-1")
        if hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
            return None
        return JSONResponse({"detail": "missing or wrong bearer token (Authorization: Bearer <key>)"}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, scope, receive):
        limit = self.settings.max_body_bytes
        too_large = JSONResponse({"detail": f"request body over the limit of {limit} bytes"}, status_code=413)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return b"", too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None


def _finite(x, default: float = 0.0) -> float:
    return float(x) if x is not None and isinstance(x, (int, float)) and math.isfinite(x) else default


@dataclasses.dataclass(frozen=True)
class RewardRow:
    """One rollout's reward and the parts the RL frameworks log."""
    reward: float            # composite; the gate value when gated or unscorable
    score: float             # P(pass) in [0, 1]; 0 when gated or unscorable
    p_pass: float
    rule_score: float
    n_issues: float
    img: float               # -1: no image term
    gated: float
    error: float             # 1.0 when the sample could not be scored (``why`` says why)
    why: str | None

    LOGGED = ("p_pass", "rule_score", "n_issues", "img", "gated", "error")

    @classmethod
    def of(cls, row: dict, error: str | None, gate: float) -> "RewardRow":
        """From a ``launch.score`` row, or an error found before scoring."""
        error = error or row.get("error")
        if error is not None:
            return cls(reward=gate, score=0.0, p_pass=0.0, rule_score=gate, n_issues=0.0, img=-1.0, gated=1.0,
                       error=1.0, why=error)
        gated = bool(row["components"]["gated"])
        p_pass = _finite(row["p_pass"])
        return cls(reward=float(row["reward"]), score=0.0 if gated else min(max(p_pass, 0.0), 1.0), p_pass=p_pass,
                   rule_score=float(row["rule_score"]), n_issues=float(len(row["issues"])),
                   img=_finite(row["img"], -1.0), gated=float(gated), error=0.0, why=None)

    def slime(self) -> api.SlimeRewardResponse:
        return api.SlimeRewardResponse(reward=self.reward, score=self.score, p_pass=self.p_pass,
                                       rule_score=self.rule_score, n_issues=self.n_issues, img=self.img,
                                       gated=self.gated, error=self.why)


def _json_safe(x):
    """``x`` with every non-finite float as its string: Python's JSON parser takes ``NaN`` and
    ``Infinity`` literals, and a 422 that echoes them back must still serialize."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


async def _validation_error(_request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": _json_safe(jsonable_encoder(exc.errors()))}, status_code=422)


def create_app(engine, settings: ServeSettings) -> FastAPI:
    """``engine``: an ``rm_jax.serve.engine.Engine`` (loaded; its device calls run on the worker)."""
    metrics = ServerMetrics.create()
    # Scoring is batched continuously (rm_jax.serve.stream): device batches of max_batch samples
    # formed across requests; chat coalesces requests per call.
    observe = lambda kind, n: metrics.batch_size.labels(kind_label(kind)).observe(n)
    batcher = Batcher(engine.run_batch, max_batch=settings.max_batch, max_wait_s=settings.max_wait_ms / 1000.0,
                      max_queue=settings.max_queue, batch_limits={KIND_CHAT: min(settings.max_batch, 8)},
                      stream=engine.score_stream(max_wait_s=settings.max_wait_ms / 1000.0, on_batch=observe),
                      on_batch=observe,
                      on_depth=metrics.queue_depth.set)

    counter = CompileCounter.install()
    metrics.compiles.set_function(lambda: counter.compiles)
    ready = threading.Event()

    def get_ready() -> None:
        """Compile the ladder (live, not ready: /healthz says starting), then serve. A ladder that
        fails is a failed start: the process exits with status 1 rather than serving shapes that
        would compile (or crash) under traffic."""
        if settings.warmup:
            shapes = shape_ladder(engine.scorer)
            logging.info("compiling the shape ladder: %d shapes", len(shapes))
            try:
                got = warm_ladder(engine.scorer, shapes, log_progress, budget=MapBudget.of_process())
            except Exception as e:  # noqa: BLE001 -- any failure here ends the start, with its reason
                logging.error("the server cannot start: %s", e)
                logging.flush()
                os._exit(1)
            logging.info("shape ladder ready: %d shapes in %.1f s, %d compiles", got["shapes"], got["seconds"],
                         got["compiles"])
        batcher.start()         # requests admitted meanwhile waited in the queue
        ready.set()
        metrics.ready.set(1)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        warming = threading.Thread(target=get_ready, name="rm_jax-warmup", daemon=True)
        warming.start()
        try:
            yield
        finally:
            await asyncio.to_thread(warming.join)
            # uvicorn has already waited for the requests in flight (SIGTERM); finish what the
            # worker still holds, off the event loop.
            await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="rm_jax judge", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.state.engine, app.state.batcher, app.state.metrics = engine, batcher, metrics
    created = int(time.time())

    async def submit(kind: str, payload, size: int):
        try:
            return await batcher.submit(kind, payload, size)
        except QueueFull as e:
            raise HTTPException(503, str(e), headers={"Retry-After": str(e.retry_after_s)}) from None
        except ShuttingDown as e:
            raise HTTPException(503, str(e), headers={"Retry-After": "5"}) from None
        except JobTooLarge as e:
            raise HTTPException(413, str(e)) from None

    @app.get("/healthz", response_model=None)
    async def healthz():
        if not ready.is_set():
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "5"})
        return api.Health(status="ok", step=engine.step, model_type=engine.model_type, queue=batcher.depth)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=api.ModelList)
    async def models():
        return api.ModelList(data=[api.ModelCard(id=engine.model_id, created=created)])

    @app.post("/v1/chat/completions", response_model=api.ChatCompletion)
    async def chat(req: api.ChatRequest):
        if req.model != engine.model_id:
            return JSONResponse({"error": {"message": f"model {req.model!r} is not served here; GET /v1/models "
                                                      f"lists {engine.model_id!r}", "type": "invalid_request_error",
                                           "code": "model_not_found"}}, status_code=404)
        messages = [m.model_dump() for m in req.messages]
        try:
            prompt = await asyncio.to_thread(
                engine.prepare_chat, messages, temperature=req.temperature,
                max_tokens=req.max_completion_tokens or req.max_tokens,
                top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0, seed=req.seed)
        except ChatInputError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "code": None}},
                                status_code=400)
        out = await submit(KIND_CHAT, prompt, 1)
        logprobs = None
        if req.logprobs:
            def entry(tid: int, lp: float) -> dict:
                text = engine.token_text(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            logprobs = api.ChoiceLogprobs(content=[
                api.TokenLogprob(**entry(t, lp), top_logprobs=[api.TopLogprob(**entry(i, l)) for i, l in alts])
                for t, lp, alts in zip(out.token_ids, out.logprobs, out.top)])
        n_out = len(out.token_ids)
        return api.ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=engine.model_id,
            choices=[api.Choice(index=0, message=api.AssistantMessage(content=out.text),
                                finish_reason=out.finish_reason, logprobs=logprobs)],
            usage=api.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=n_out,
                            total_tokens=out.prompt_tokens + n_out))

    async def score_samples(objs: list, mode: ScoreMode) -> list[dict]:
        parsed = [parse_request_sample(o, i, settings.image_root) for i, o in enumerate(objs)]
        good = [s for s in parsed if not isinstance(s, BadSample)]
        rows = iter(await submit(mode, good, len(good)) if good else [])
        out = [p.row() if isinstance(p, BadSample) else next(rows) for p in parsed]
        for row in out:
            metrics.samples.labels(kind_label(mode), "error" if "error" in row else "ok").inc()
        return out

    @app.post("/v1/score", response_model=api.ScoreResponse)
    async def score(req: api.ScoreRequest):
        return api.ScoreResponse(results=await score_samples(req.samples, ScoreMode(req.mode)))

    rollouts = RolloutParser(engine.assistant_start, engine.call_format, keep_think=settings.keep_think)
    gate = float(engine.reward.penalties.gate_reward)

    async def rewards_of(objs: list, pre_errors: dict[int, str]) -> list[RewardRow]:
        rows = await score_samples([o if o is not None else {} for o in objs], ScoreMode.FULL)
        return [RewardRow.of(row, pre_errors.get(i), gate) for i, row in enumerate(rows)]

    @app.post("/get_reward", response_model=None)
    async def get_reward(req: api.GetRewardRequest | api.SlimeRewardRequest):
        if isinstance(req, api.SlimeRewardRequest):
            try:
                objs, pre = [rollouts.sample(req.label, req.response, "slime-0", "label")], {}
            except ValueError as e:
                objs, pre = [None], {0: str(e)}
            return (await rewards_of(objs, pre))[0].slime()
        n = len(req.query)
        for name, values in (("prompts", req.prompts), ("labels", req.labels)):
            if len(values) != n:
                raise HTTPException(422, f"{name} has {len(values)} entries for {n} queries: one each is required")
        objs, pre_errors = [], {}
        for i, (query, prompt, label) in enumerate(zip(req.query, req.prompts, req.labels)):
            try:
                text = rollouts.response_text(query, prompt)
            except ValueError as e:
                objs.append(None)
                pre_errors[i] = f"query[{i}]: {e}"
                continue
            try:
                objs.append(rollouts.sample(label, text, f"get_reward-{i}", f"labels[{i}]"))
            except ValueError as e:
                objs.append(None)
                pre_errors[i] = str(e)
        got = await rewards_of(objs, pre_errors)
        logs = {k: [getattr(r, k) for r in got] for k in RewardRow.LOGGED}
        # OpenRLHF trains on "rewards" and filters on "scores", a pass rate in [0, 1].
        return api.GetRewardResponse(rewards=[r.reward for r in got], scores=[r.score for r in got], extra_logs=logs,
                                     errors=[r.why for r in got])

    return _Guard(app, settings, metrics), app
