"""verl reward functions backed by the judge server, in each form verl calls.

verl config (``custom_reward_function``)::

    custom_reward_function.path=<repo>/rm_jax/rl/verl_reward.py
    custom_reward_function.name=compute_score          # the async reward loop (reward_manager naive/dapo/...)
    # or name=compute_score_sync   (legacy NaiveRewardManager, RemoteRewardManager: a plain function)
    # or name=compute_score_batch  (reward_model.reward_manager=batch: lists in, a list out)
    # optional: custom_reward_function.reward_kwargs.url=http://127.0.0.1:8000

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)`` once
per rollout. ``solution_str`` is the policy's decoded text (tool calls as ``<tool_call>`` blocks,
Hermes JSON or Qwen3.5 XML; the server parses both); the sample context is ``ground_truth`` (the
dataset's ``reward_model.ground_truth``: the sample JSON without ``response``), or
``extra_info["sample"]`` when ``ground_truth`` is empty. Each returns ``score`` (the reward verl
trains on) and the fixed keys ``p_pass``, ``rule_score``, ``n_issues``, ``img``, ``gated``, which
verl logs.

All forms go through ``rm_jax.rl.client``: per-rollout calls are coalesced into batched
requests, requests in flight are bounded, a busy server is retried after its ``Retry-After``,
and a request that still fails gives its rollouts the gate reward (logged and counted in
``client_stats()``) instead of failing the RL step. Tune with reward_kwargs: ``batch_size``,
``max_in_flight``, ``deadline_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Sequence

from rm_jax.rl.client import ClientSettings, ClientStats, RewardClient, SyncRewardClient

_async_clients: dict[tuple, RewardClient] = {}
_sync_clients: dict[ClientSettings, SyncRewardClient] = {}
_SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(ClientSettings))


def _settings(kwargs: dict) -> ClientSettings:
    """ClientSettings from verl's reward_kwargs; other keyword arguments verl passes are ignored."""
    return ClientSettings(**{k: v for k, v in kwargs.items() if k in _SETTING_NAMES})


def _context(ground_truth: Any, extra_info: dict | None) -> Any:
    if ground_truth:
        return ground_truth
    sample = (extra_info or {}).get("sample")
    # No context: the server answers this row with why, and the gate reward.
    return sample if sample is not None else "null"


def _async_client(settings: ClientSettings) -> RewardClient:
    """One client per event loop and settings (its connections and coalescing belong to the loop)."""
    key = (id(asyncio.get_running_loop()), settings)
    client = _async_clients.get(key)
    if client is None:
        client = _async_clients[key] = RewardClient(settings)
    return client


def _sync_client(settings: ClientSettings) -> SyncRewardClient:
    client = _sync_clients.get(settings)
    if client is None:
        client = _sync_clients[settings] = SyncRewardClient(settings)
    return client


def client_stats() -> ClientStats:
    """Requests, retries and gated samples over every client of this process."""
    total = ClientStats()
    for stats in [c.stats for c in _async_clients.values()] + [c.stats for c in _sync_clients.values()]:
        total.requests += stats.requests
        total.retries += stats.retries
        total.failed_samples += stats.failed_samples
        total.last_error = stats.last_error or total.last_error
    return total


async def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                        **kwargs) -> dict:
    """verl's reward loop form (a coroutine function: many rollouts in flight)."""
    del data_source
    rec = await _async_client(_settings(kwargs)).score_one(solution_str, _context(ground_truth, extra_info))
    return rec.to_verl()


def compute_score_sync(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                       **kwargs) -> dict:
    """verl's synchronous form (legacy NaiveRewardManager, RemoteRewardManager, thread pools)."""
    del data_source
    return _sync_client(_settings(kwargs)).score_one(solution_str, _context(ground_truth, extra_info)).to_verl()


def compute_score_batch(data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
                        extra_infos: Sequence[dict | None] | None = None, **kwargs) -> list[dict]:
    """verl's BatchRewardManager form: every rollout of the step in one call."""
    del data_sources
    infos = list(extra_infos) if extra_infos is not None else [None] * len(solution_strs)
    contexts = [_context(g, e) for g, e in zip(ground_truths, infos)]
    return [r.to_verl() for r in _sync_client(_settings(kwargs)).score(list(solution_strs), contexts)]
