"""The embedded scalar Bradley–Terry RM: the tiny Qwen3-VL-MoE backbone + a Linear(D, 1) head,
trained on preference pairs from the synthetic generator's groups (make rm-demo).

Usage: --config=configs/rm_tiny.py [--config.rm.steps=N ...]
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
    cfg = tiny.get_config()
    cfg.name = "rm_tiny"
    cfg.data.calibration_fraction = 0.15   # by prompt_id, apart from held-out: the temperature is fitted there
    cfg.data.heldout_fraction = 0.15
    cfg.train.init_from = ""               # HF checkpoint dir of the backbone; "" = random init
    cfg.train.lr = 3e-3                   # as the judge: a random-init tiny backbone needs a high rate
    cfg.train.warmup_steps = 20
    cfg.rm = ml_collections.ConfigDict(dict(
        steps=240,
        groups=2,                # prompt groups per (global) microbatch: whole groups, a multiple of the processes
        rows=8,                  # candidate rows per microbatch: rows/groups per group (synthetic groups: 4)
        pairs=12,                # pair slots per microbatch: pairs/groups per group (4 candidates: 6 pairs)
        grad_accum=1,
        group_normalize=True,    # mean within each prompt, then over prompts
        center_coef=0.01,        # coef * ((r_a + r_b) / 2)^2: fixes the reward's zero
        max_patches=4096,        # vision patches per microbatch (static)
        max_images=32,
        checkpoint_every=120,
        log_every=10,
        eval_rows=8,
    ))
    return cfg
