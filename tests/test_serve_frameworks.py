"""The RL frameworks' own code against a live ``launch.serve`` (the ``rl`` extra; slow).

* TRL: ``GRPOTrainer`` trains 2 steps of a tiny random causal LM (built here) with
  ``reward_funcs=[JudgeReward(url)]``; the rewards TRL logs are the server's.
* OpenRLHF: its ``SingleTurnAgentExecutor`` (the remote-reward client of ``openrlhf.utils.agent``)
  decodes prompt + response ids and posts them to ``/get_reward``; a VLM-shaped query (image
  pads expanded) through its ``_fetch_rewards_via_http``. vLLM (the executor's engine) does not
  install without a GPU: a stand-in engine returns fixed response token ids, everything else is
  OpenRLHF's code.
* verl: rm_jax's functions loaded by verl's ``get_custom_reward_fn`` (by file path, as a verl run
  does) and called by verl's legacy ``NaiveRewardManager`` (sync), ``BatchRewardManager`` (batch)
  and the reward loop's ``NaiveRewardManager.run_single`` (async), on a ``DataProto``.
"""

import asyncio
import copy
import json
import os
import types

import httpx
import numpy as np
import pytest

from rm_jax.data.schema import decode_arguments
from serve_fixtures import REPO, JudgeServer, make_judge_workdir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cfg, built_shards, renderer, synth_dir):
    root = tmp_path_factory.mktemp("frameworks")
    workdir = make_judge_workdir(root, tiny_cfg, built_shards[0], renderer)
    srv = JudgeServer(workdir, "--max_batch=8", "--tool_call_format=auto", f"--image_root={synth_dir}",
                      cache_dir=root / "jax_cache")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def samples(synth_dir):
    with open(os.path.join(synth_dir, "samples.jsonl")) as f:
        return {r["id"]: r for r in map(json.loads, f)}


def _label(sample) -> str:
    return json.dumps({k: v for k, v in sample.items() if k != "response"})


def _xml(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _reference(server, queries, labels):
    body = {"query": queries, "prompts": [""] * len(queries), "labels": labels}
    return httpx.post(server.url + "/get_reward", json=body, timeout=300).json()


def test_trl_grpo_trainer_two_steps_logs_the_servers_rewards(server, samples, renderer, tmp_path):
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rm_jax.rl.trl_reward import JudgeReward

    tok = renderer.tokenizer
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")))
    picked = [samples[f"p{k}-s0"] for k in range(8)]
    ds = Dataset.from_list([{"prompt": s["messages"][-1]["content"] if isinstance(s["messages"][-1]["content"], str)
                             else "judge this", "sample": _label(s)} for s in picked])
    reward = JudgeReward(server.url)
    calls = []

    def recorded(prompts, completions, **kwargs):      # what TRL hands the reward and gets back
        out = reward(prompts=prompts, completions=completions, **kwargs)
        calls.append((list(completions), list(kwargs["sample"]), out))
        return out
    recorded.__name__ = reward.__name__
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=2, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=12, logging_steps=1, report_to="none",
                      use_cpu=True, save_strategy="no", bf16=False, temperature=1.0, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[recorded], args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    logged = [h["rewards/rm_jax_judge/mean"] for h in trainer.state.log_history if "rewards/rm_jax_judge/mean" in h]
    assert len(logged) == 2 and len(calls) == 2
    for (completions, labels, got), mean in zip(calls, logged):
        ref = _reference(server, completions, labels)
        np.testing.assert_allclose(got, ref["rewards"], atol=1e-5)        # what TRL got is the server's
        assert abs(float(np.mean(got)) - mean) < 1e-4                      # and what TRL logged
    assert reward.stats.failed_samples == 0


def test_openrlhf_reward_client_posts_vlm_and_qwen35_queries(server, samples, renderer):
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    tok = renderer.tokenizer
    base = samples["p2-s0"]                                            # has images
    call = base["response"]["tool_calls"][0]["function"]
    args = decode_arguments(call["arguments"])[0]
    label = _label(base)
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                       "text": "edit it"}]}],
                                     add_generation_prompt=True, tokenize=False)
    response = "<think>\nan edit\n</think>\n\n" + _xml(call["name"], args) + "<|im_end|>"
    response_ids = tok(response, add_special_tokens=False)["input_ids"]

    class Engine:              # vLLM's place: returns the policy's token ids
        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            out = types.SimpleNamespace(token_ids=response_ids, finish_reason="stop", logprobs=None)
            return types.SimpleNamespace(outputs=[out])

    executor = SingleTurnAgentExecutor(remote_rm_url=server.url + "/get_reward")
    params = types.SimpleNamespace(max_tokens=64, logprobs=None)
    out = asyncio.run(executor.execute(prompt, label, params, 1024, tok, Engine()))
    ref = _reference(server, [response], [label])
    # the executor keeps the server's lists for its one query
    assert out["reward"] == pytest.approx(ref["rewards"], abs=1e-5) and ref["errors"] == [None]
    assert out["scores"] == pytest.approx(ref["scores"], abs=1e-5) and 0.0 < out["scores"][0] < 1.0
    assert out["extra_logs"]["gated"] == [0.0]

    # a VLM query as OpenRLHF decodes it: every image placeholder expanded into many pads
    expanded = prompt.replace("<|image_pad|>", "<|image_pad|>" * 80) + response
    got = asyncio.run(executor._fetch_rewards_via_http([expanded], [prompt], [label]))[0]
    assert got["rewards"][0] == pytest.approx(ref["rewards"][0], abs=1e-5)
    assert got["scores"][0] == pytest.approx(ref["scores"][0], abs=1e-5)


def _data_proto(tok, prompts, responses, labels):
    import torch
    from verl import DataProto
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    P, R, pad = max(map(len, p_ids)), max(map(len, r_ids)), tok.pad_token_id
    prompts_t = torch.tensor([[pad] * (P - len(x)) + x for x in p_ids])          # left-padded, as verl
    responses_t = torch.tensor([x + [pad] * (R - len(x)) for x in r_ids])
    mask = torch.tensor([[0] * (P - len(a)) + [1] * len(a) + [1] * len(b) + [0] * (R - len(b))
                         for a, b in zip(p_ids, r_ids)])
    return DataProto.from_dict(
        tensors={"prompts": prompts_t, "responses": responses_t, "attention_mask": mask,
                 "input_ids": torch.cat([prompts_t, responses_t], 1)},
        non_tensors={"data_source": np.array(["tool_agent"] * len(prompts), dtype=object),
                     "reward_model": np.array([{"ground_truth": g} for g in labels], dtype=object),
                     "extra_info": np.array([{} for _ in labels], dtype=object)})


def test_verl_reward_managers_call_compute_score_in_each_form(server, samples, renderer):
    from omegaconf import OmegaConf
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager as LoopNaive
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.workers.reward_manager.batch import BatchRewardManager
    from verl.workers.reward_manager.naive import NaiveRewardManager

    tok = renderer.tokenizer
    picked = [samples[i] for i in ("p5-s0", "p2-s0", "p0-s0")]
    responses = []
    for s in picked:
        calls = s["response"].get("tool_calls") or []
        text = s["response"].get("content") or ""
        for c in calls:
            text += "\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": decode_arguments(c["function"]["arguments"])[0]}) \
                    + "\n</tool_call>"
        responses.append(text.strip() + "<|im_end|>")
    responses.append("<tool_call>\n{\"name\": \"generate_image\", \"arguments\": {")        # truncated: gated
    picked.append(picked[0])
    labels = [_label(s) for s in picked]
    data = _data_proto(tok, ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"] * len(labels), responses,
                       labels)
    # verl decodes with skip_special_tokens=True: the reference sees the same text
    decoded = [tok.decode(tok(r, add_special_tokens=False)["input_ids"], skip_special_tokens=True) for r in responses]
    ref = _reference(server, decoded, labels)
    assert ref["extra_logs"]["gated"][-1] == 1.0 and ref["rewards"][-1] == -2.0

    def load(name):
        cfg = OmegaConf.create({"reward": {"custom_reward_function": {
            "path": os.path.join(REPO, "rm_jax", "rl", "verl_reward.py"), "name": name,
            "reward_kwargs": {"url": server.url}}}})
        return get_custom_reward_fn(cfg)

    def last_token_rewards(reward_tensor, mask):
        n = mask[:, -reward_tensor.shape[1]:].sum(-1)
        return [float(reward_tensor[i, n[i] - 1]) for i in range(len(n))]

    sync = NaiveRewardManager(tok, num_examine=0, compute_score=load("compute_score_sync"))
    out = sync(data, return_dict=True)
    got = last_token_rewards(out["reward_tensor"], data.batch["attention_mask"])
    np.testing.assert_allclose(got, ref["rewards"], atol=1e-5)
    assert out["reward_extra_info"]["gated"] == ref["extra_logs"]["gated"]

    batch = BatchRewardManager(tok, num_examine=0, compute_score=load("compute_score_batch"))
    got = last_token_rewards(batch(data), data.batch["attention_mask"])
    np.testing.assert_allclose(got, ref["rewards"], atol=1e-5)

    loop_fn = load("compute_score")
    assert asyncio.iscoroutinefunction(loop_fn)
    manager = LoopNaive(OmegaConf.create({}), tok, loop_fn)

    async def all_rollouts():
        return await asyncio.gather(*(manager.run_single(data[i:i + 1]) for i in range(len(data))))
    results = manager.loop.run_until_complete(all_rollouts())
    np.testing.assert_allclose([r["reward_score"] for r in results], ref["rewards"], atol=1e-5)
    assert copy.deepcopy(results[-1]["reward_extra_info"])["gated"] == 1.0
