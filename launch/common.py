"""What every entry point shares: the default config path, the config flag and its parsing."""

from __future__ import annotations

import os

from ml_collections import config_flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "tiny.py")
# The embedded default's pretrained base (launch.pretrain_base), the demo's start.
DEFAULT_BASE = os.path.join("assets", "tiny_base")


def define_config_flag(default: str = DEFAULT_CONFIG):
    """`--config=configs/X.py --config.a.b=v` (ml_collections)."""
    return config_flags.DEFINE_config_file("config", default, "ml_collections config file", lock_config=False)


def parse_config(cfg):
    """The run config, parsed once into typed records (rm_jax.run_config); everything below the
    launcher receives those. An unknown key or a bad value is a usage error naming its path."""
    from absl import app

    from rm_jax import run_config
    try:
        return run_config.parse(cfg)
    except ValueError as e:
        raise app.UsageError(f"--config: {e}") from None


def load_config(path: str):
    """A config file's `get_config()`, outside absl flag parsing (demo, tests, benchmarks)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"rm_jax_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


class _DropLibraryInfo:
    """Keeps INFO chatter of named libraries out of the log; their warnings and errors (with
    tracebacks) still come through: a failing background writer must never be hidden."""

    def __init__(self, fragments: tuple[str, ...]):
        self.fragments = fragments

    def filter(self, record) -> bool:
        import logging as py_logging
        return record.levelno >= py_logging.WARNING or not any(f in record.pathname for f in self.fragments)


def quiet_library_info(fragments: tuple[str, ...] = ("/orbax/",)) -> None:
    import logging as py_logging

    from absl import logging
    handler = logging.get_absl_handler()
    handler.addFilter(_DropLibraryInfo(fragments))
    py_logging.getLogger().setLevel(py_logging.INFO)
    logging.set_verbosity(logging.INFO)


def define_reward_flags():
    """The reward's weights and rule penalties as flags (defaults: the field report's formula).
    Returns a function giving the ``RewardSettings`` after flag parsing."""
    from absl import flags

    from rm_jax.score.reward import RewardSettings, RewardWeights
    from rm_jax.score.rules import RulePenalties
    w, p = RewardWeights(), RulePenalties()
    f_pass = flags.DEFINE_float("w_p_pass", w.p_pass, "reward weight of (2 P(pass) - 1)")
    f_issues = flags.DEFINE_float("w_issues", w.issues, "reward weight per issue the judge lists (subtracted)")
    f_img = flags.DEFINE_float("w_img", w.img, "reward weight of (img - 5) / 5 (0 without an image)")
    f_gate = flags.DEFINE_float("gate_reward", p.gate_reward, "total reward of a malformed or unknown tool call")
    f_missing = flags.DEFINE_float("missing_required_penalty", p.missing_required, "rule score per missing required arg")
    f_dup = flags.DEFINE_float("duplicate_call_penalty", p.duplicate_call, "rule score per duplicate call")

    def values():
        return RewardSettings(RewardWeights(p_pass=f_pass.value, issues=f_issues.value, img=f_img.value),
                              RulePenalties(gate_reward=f_gate.value, missing_required=f_missing.value,
                                            duplicate_call=f_dup.value))
    return values


def define_cluster_flags():
    """--coordinator_address/--num_processes/--process_id (all three, explicitly, or none: launch
    safety, rm_jax.train.distributed). Returns a function giving the ``ClusterFlags``."""
    from absl import flags
    coord = flags.DEFINE_string("coordinator_address", "", "multi-host: coordinator host:port")
    nproc = flags.DEFINE_integer("num_processes", 1, "multi-host: number of processes")
    pid = flags.DEFINE_integer("process_id", 0, "multi-host: this process's id")

    def values():
        from rm_jax.train.distributed import ClusterFlags
        return ClusterFlags(coord.value, nproc.value, pid.value)
    return values


def refuse_multi_process(job: str, cluster) -> None:
    """Jobs that run in one process say so instead of joining a cluster half-way."""
    from absl import app
    if cluster.multi_host or cluster.num_processes != 1 or cluster.process_id != 0:
        raise app.UsageError(
            f"launch.{job} runs in one process and does not join a cluster (got --coordinator_address="
            f"{cluster.coordinator_address!r} --num_processes={cluster.num_processes} --process_id="
            f"{cluster.process_id}): run it once, on one host; it rebuilds the run's mesh over that host's "
            "devices (falling back to data parallelism over fewer devices, logged)")


def run_stage(stage: str, args: list[str], timings: dict, key: str) -> None:
    """`python -m launch.<stage> ARGS` from the repo root (a failure raises), timed as timings[key]:
    how the drivers (launch.ablate, benchmarks.judge_levers) run each stage as a user would."""
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", f"launch.{stage}", *args]
    print(f"\n=== {key}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    timings[key] = round(time.time() - t0, 2)


def metrics_at(sweep: dict, step: int) -> dict:
    """The judge_metrics keys of one swept step of a sweep.json (the sweep stores the chosen step's
    in full and a table row for every step; n, n_fail and the majority baseline are the held-out set's)."""
    from rm_jax.metrics import METRIC_KEYS

    chosen = sweep["chosen"]
    if step == chosen["step"]:
        return {"step": step, **{k: chosen[k] for k in METRIC_KEYS}}
    row = next(r for r in sweep["rows"] if r["step"] == step)
    return {"step": step, **{k: row.get(k, chosen[k]) for k in METRIC_KEYS}}


def resolve_base(flag_value: str, config_path: str):
    """--base: '' -> (None, ''); else the checked provenance and the base's HF dir (relative paths
    from the repo root). A stale or missing base is a usage error naming the script that rebuilds it;
    so is a base of another architecture than the config's model, since the policy would silently
    take the base's architecture (train.init_from reads the checkpoint's config.json)."""
    from absl import app

    from rm_jax.data.base_provenance import StaleBaseError, check_base
    if not flag_value:
        return None, ""
    base = os.path.abspath(os.path.join(REPO_ROOT, flag_value))
    try:
        provenance = check_base(base)
    except (StaleBaseError, FileNotFoundError) as e:
        raise app.UsageError(f"--base={flag_value}: {e}") from None
    differing = architecture_difference(os.path.join(base, "hf"), config_path)
    if differing:
        shown = ", ".join(differing[:6]) + (", ..." if len(differing) > 6 else "")
        raise app.UsageError(f"--base={flag_value}: its architecture is not the model of {config_path} (they "
                             f"differ in {shown}); pass a base of that architecture, or --base='' for random init")
    return provenance, os.path.join(base, "hf")


def architecture_difference(hf_dir: str, config_path: str) -> list[str]:
    """The HF config fields (text_config.x for nested ones) in which a checkpoint's architecture
    and a config file's model differ; [] when they are the same. The saved dtype is not compared."""
    from rm_jax.model.convert import read_config
    from rm_jax.run_config import model_config, parse

    got = read_config(hf_dir).to_hf_dict()
    want = model_config(parse(load_config(config_path))).to_hf_dict()
    differing = []
    for key in sorted((set(got) | set(want)) - {"dtype"}):
        a, b = got.get(key), want.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differing += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            differing.append(key)
    return differing
