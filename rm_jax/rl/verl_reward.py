"""verl custom reward function backed by the judge server.

verl config (``custom_reward_function``)::

    custom_reward_function.path=<repo>/rm_jax/rl/verl_reward.py
    custom_reward_function.name=compute_score
    # optional: custom_reward_function.reward_kwargs.url=http://127.0.0.1:8000

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)`` once
per rollout; its reward loop awaits coroutine functions, so many rollouts are in flight at once
and the server coalesces them into device batches. ``solution_str`` is the policy's decoded text
(tool calls as ``<tool_call>`` blocks); the sample context is ``ground_truth`` (the dataset's
``reward_model.ground_truth``: the sample JSON without ``response``), or ``extra_info["sample"]``
when ``ground_truth`` is empty. The returned dict has ``score`` (the reward verl trains on) and
the fixed keys ``p_pass``, ``rule_score``, ``n_issues``, ``img``, ``gated``, which verl logs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from rm_jax.rl.common import auth_headers, records, reward_request, server_url

_clients: dict[int, httpx.AsyncClient] = {}


def _client() -> httpx.AsyncClient:
    """One pooled client per event loop (an AsyncClient must not cross loops)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(id(loop))
    if client is None or client.is_closed:
        client = _clients[id(loop)] = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                                                        limits=httpx.Limits(max_connections=256))
    return client


async def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                        *, url: str | None = None, api_key: str | None = None, **kwargs) -> dict:
    del data_source, kwargs
    context = ground_truth if ground_truth else (extra_info or {}).get("sample")
    if context is None:
        raise ValueError("compute_score: no sample context: put the sample JSON without response in "
                         "reward_model.ground_truth (or extra_info['sample'])")
    for attempt in range(5):
        resp = await _client().post(server_url(url) + "/get_reward", json=reward_request([solution_str], [context]),
                                    headers=auth_headers(api_key))
        if resp.status_code != 503:
            break
        await asyncio.sleep(float(resp.headers.get("Retry-After", "1")) * (attempt + 1))
    resp.raise_for_status()
    return records(resp.json())[0].to_verl()
