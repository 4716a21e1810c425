"""Train-step throughput: rm_jax (StepBuilder, jitted) vs transformers + torch.optim.AdamW.

    python -m benchmarks.train_vs_hf [--batch=4 --seq=512 --images=2 --iters=7]

Same tiny config (configs/tiny.py), same weights (the HF model is saved and loaded with
``load_hf``), same batch (random tokens, images in place, a verdict-sized target at the end of
each row; loss on the target tokens only), fp32, one CPU device, the same thread count for both.
Both steps are AdamW (b1 0.9, b2 0.95, no decay) after global-norm clipping at 1.0, as
rm_jax.train.optim builds it. Prints tokens/s of each and the ratio, then the rm_jax step's
achieved FLOP rate as a fraction of this CPU's dense fp32 matmul rate. Last line: one JSON
object. A measurement, not a test: nothing is asserted.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import tempfile  # noqa: E402

from absl import app, flags  # noqa: E402
from benchmarks.timing import median_seconds  # noqa: E402
from rm_jax.model.config import hf_config_dict  # noqa: E402

flags.DEFINE_integer("batch", 4, "sequences per step")
flags.DEFINE_integer("seq", 512, "tokens per sequence")
flags.DEFINE_integer("images", 2, "images per batch (8x12 patches each, rows 0..)")
flags.DEFINE_integer("target", 48, "target (verdict JSON) tokens at the end of each row")
flags.DEFINE_integer("iters", 7, "timed steps (after two warm-ups)")


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from configs import tiny
    from rm_jax.model import load_hf
    from rm_jax.model.config import RuntimeOptions
    from rm_jax.model import prepare_inputs
    from rm_jax.sharding import make_mesh
    from rm_jax.train import optim
    from rm_jax.train.loss import LossConfig
    from rm_jax.train.step import StepBatch, StepBuilder, StepConfig

    f = flags.FLAGS
    n_threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(n_threads)
    tcfg = tiny.get_config()

    torch.manual_seed(0)
    hf = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**hf_config_dict(tcfg.model.to_dict())))
    tmp = tempfile.mkdtemp()
    hf.save_pretrained(tmp)
    hf.train()

    # ---- batch (numpy), shared by both ---------------------------------------------------------
    model, mcfg = load_hf(tmp)
    rng = np.random.default_rng(0)
    b, t = f.batch, f.seq
    ids = rng.integers(20, mcfg.text.vocab_size, (b, t))
    grids = np.array([[1, 8, 12]] * f.images, np.int64).reshape(-1, 3)
    n_img = 8 * 12 // mcfg.vision.spatial_merge_size ** 2
    for row in range(f.images):
        ids[row, 10], ids[row, 11:11 + n_img], ids[row, 11 + n_img] = (
            mcfg.vision_start_token_id, mcfg.image_token_id, mcfg.vision_end_token_id)
    mask = np.ones_like(ids)
    target = np.zeros_like(ids)
    target[:, t - f.target:] = 1
    pixels = rng.standard_normal((int(np.prod(grids, -1).sum()), mcfg.vision.patch_dim)).astype(np.float32)
    img_kw = dict(pixel_values=pixels, image_grid_thw=grids) if f.images else {}

    # ---- rm_jax: the trainer's StepBuilder on one device -----------------------------------------
    ocfg = optim.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=1000, b1=0.9, b2=0.95, weight_decay=0.0,
                             clip_norm=1.0)
    step_cfg = StepConfig(loss=LossConfig(int(tcfg.train.max_target_tokens), int(tcfg.train.vocab_chunk)))
    mesh = make_mesh(None, devices=jax.devices()[:1])

    def build(m):
        builder = StepBuilder(m, optim.make_optimizer(ocfg, m), step_cfg, mesh, optim.schedule(ocfg))
        state = builder.init_state()
        inputs = prepare_inputs(mcfg, ids, mask, attention="lengths", **img_kw)   # as loop.assemble
        batch = StepBatch(inputs=jax.tree.map(lambda x: np.asarray(x)[None], inputs), target_mask=target[None])
        with jax.set_mesh(mesh):
            compiled = builder.jit_train(state, batch).lower(state, builder.rest, batch).compile()
        return builder, state, batch, compiled

    builder, state, batch, compiled = build(model)
    # XLA's cost analysis counts a scan body once: count FLOPs on an unrolled twin of the step.
    twin, _ = load_hf(tmp, runtime=RuntimeOptions(scan_layers=False))
    flops = _flops(build(twin)[3])
    flops_scanned = _flops(compiled)
    holder = {"state": state}

    def jax_step():
        with jax.set_mesh(mesh):
            holder["state"], metrics = compiled(holder["state"], builder.rest, batch)
        return metrics["loss"].block_until_ready()

    jax_loss0 = float(jax_step())

    # ---- transformers + torch.optim.AdamW ----------------------------------------------------------
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    labels = torch.tensor(np.where(target > 0, ids, -100))
    tkw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=labels)
    if f.images:
        tkw.update(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                   mm_token_type_ids=torch.tensor((ids == mcfg.image_token_id).astype(np.int64)))

    def hf_step():
        opt.zero_grad(set_to_none=True)
        loss = hf(**tkw).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        return loss

    hf_loss0 = float(hf_step().detach())

    jax_s = median_seconds(jax_step, f.iters)
    hf_s = median_seconds(hf_step, f.iters)

    # ---- this CPU's dense fp32 matmul rate ----------------------------------------------------------
    n = 2048
    x = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    mm_s = median_seconds(lambda: mm(x, y).block_until_ready(), 9)
    mm_rate = 2 * n ** 3 / mm_s
    rate = flops / jax_s

    tokens = b * t
    print(f"threads: jax (XLA CPU) {n_threads}, torch {torch.get_num_threads()}; batch {b} x {t}, "
          f"{f.images} images ({int(np.prod(grids, -1).sum())} patches), {f.target} target tokens/row")
    print(f"first-step loss (same weights, same batch): rm_jax {jax_loss0:.5f}  transformers {hf_loss0:.5f}")
    print(f"{'impl':<14}{'s/step':>10}{'tokens/s':>12}")
    print(f"{'rm_jax':<14}{jax_s:>10.4f}{tokens / jax_s:>12.0f}")
    print(f"{'transformers':<14}{hf_s:>10.4f}{tokens / hf_s:>12.0f}")
    print(f"speedup rm_jax / transformers: {hf_s / jax_s:.2f}x")
    print(f"rm_jax step: {flops / 1e9:.2f} GFLOP (unrolled twin; the scanned step's cost_analysis says "
          f"{flops_scanned / 1e9:.2f}) -> {rate / 1e9:.2f} GFLOP/s; dense fp32 matmul {n}^3: "
          f"{mm_rate / 1e9:.2f} GFLOP/s; fraction {rate / mm_rate:.3f}")
    print(json.dumps({"bench": "train_vs_hf", "speedup_vs_hf": round(hf_s / jax_s, 3),
                      "flop_fraction_of_matmul": round(rate / mm_rate, 4),
                      "rm_jax_tokens_per_s": round(tokens / jax_s, 1), "hf_tokens_per_s": round(tokens / hf_s, 1),
                      "rm_jax_step_s": round(jax_s, 4), "hf_step_s": round(hf_s, 4),
                      "step_gflop": round(flops / 1e9, 3), "achieved_gflops": round(rate / 1e9, 2),
                      "matmul_gflops": round(mm_rate / 1e9, 2), "threads": n_threads,
                      "first_loss_rm_jax": round(jax_loss0, 5), "first_loss_hf": round(hf_loss0, 5),
                      "batch": b, "seq": t, "images": f.images, "platform": jax.devices()[0].platform}))


if __name__ == "__main__":
    app.run(main)
