"""Can the demo's tiny judge learn a key-value comparison from a verdict alone? (issue 16 probe)

    python -m benchmarks.recall_probe --pairs=8 --steps=5000 [--recall_steps=3000]

Sequence: BOS k1 v1 ... kP vP [--filler random tokens] SEP q v [--post_filler tokens] VERDICT
(``--echo_all``: SEP k1 v1' ... kP vP', every value repeated, one possibly wrong); the label is
pass iff the repeated values are the keys' (``--fail_share`` sets how often not). The model is
configs/tiny.py's Qwen3-VL-MoE (vocab 128), trained with Adam on CE of {pass, fail} at the last
position, fresh samples every step (``--train_pool=N``: a fixed set of N, as the demo's shards);
``--recall_steps`` first trains the policy's objective (write each repeated value after its key)
on passing sequences. ``--fixed_post`` makes the post filler the same tokens every time (as the
real closing markup is). ``--value_loss`` adds a label at each repeated value's own position (the
toy form of train.value_check_weight); ``--jitter`` varies the distance between a value and its
repeat, ``--shuffle_echo`` their order. Prints held-out AUC (512 sequences) against steps and wall
seconds (and the per-value AUC with ``--value_loss``).
``--text key=value`` overrides the judge's text_config (width, depth, ``mlp_only_layers`` for
dense MLPs), ``--qk_gain`` scales the initial q/k-norm gains. A measurement, not a test.
"""
import time
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from sklearn.metrics import roc_auc_score
from configs.tiny import hf_model_config
from rm_jax.model import registry
from rm_jax.model.config import RuntimeOptions
from rm_jax.model.inputs import prepare_inputs

from absl import app, flags

flags.DEFINE_integer("steps", 5000, "verdict steps")
flags.DEFINE_integer("batch", 32, "sequences per step")
flags.DEFINE_integer("pairs", 8, "key-value pairs per sequence (1: a fixed-offset comparison)")
flags.DEFINE_float("lr", 3e-3, "peak learning rate")
flags.DEFINE_integer("recall_steps", 0, "policy-objective steps first")
flags.DEFINE_multi_string("text", [], "text_config overrides, key=value (e.g. hidden_size=128, mlp_only_layers=0,1,2,3)")
flags.DEFINE_integer("seed", 0, "model init and data seed")
flags.DEFINE_float("qk_gain", 1.0, "initial q_norm/k_norm gain (attention logits are bounded by gain^2 * sqrt(head_dim))")
flags.DEFINE_integer("filler", 0, "random filler tokens between the pairs and the query (a longer context)")
flags.DEFINE_integer("post_filler", 0, "random filler tokens between the queried value and the verdict slot")
flags.DEFINE_bool("fixed_post", False, "the post filler is the same tokens in every sequence (as the "
                  "response's closing markup and the assistant header are)")
flags.DEFINE_bool("echo_all", False, "after SEP, every key is echoed with its value (as a call repeats every "
                  "requested slot); a failing sequence has one wrong value among them")
flags.DEFINE_integer("train_pool", 0, "verdict steps draw from a fixed set of this many sequences "
                     "(0: fresh every step)")
flags.DEFINE_float("fail_share", 0.5, "share of failing sequences")
flags.DEFINE_bool("jitter", False, "a random part of the filler goes before the pairs, so the distance between "
                  "a value and its repeat varies (as between a request and a call) while the length stays fixed")
flags.DEFINE_bool("shuffle_echo", False, "with --echo_all: the keys are repeated in a random order (finding a "
                  "value's original takes its key, not its position)")
flags.DEFINE_bool("keyless", False, "the request states its values without keys (\"2K\", not \"resolution 2K\"): "
                  "each key has its own pool of values, and a value's original is found by its pool")
flags.DEFINE_integer("distractors", 0, "with --keyless: this many values from the pools before the stated ones "
                     "(an earlier turn's), so a value that occurs earlier is not thereby right")
flags.DEFINE_float("value_loss", 0.0, "with --echo_all: weight of a per-value objective, {pass, fail} at each "
                   "repeated value's own position (is this value its key's?), added to the verdict's CE")


def _override(text_config: dict, items: list[str]) -> None:
    for item in items:
        key, value = item.split("=", 1)
        if key not in text_config:
            raise ValueError(f"unknown text_config key {key!r}")
        old = text_config[key]
        if isinstance(old, (tuple, list)):
            text_config[key] = tuple(int(x) for x in value.split(",") if x)
        elif isinstance(old, bool):      # bool("False") is True
            if value not in ("True", "False"):
                raise ValueError(f"{key} takes True or False, not {value!r}")
            text_config[key] = value == "True"
        else:
            text_config[key] = type(old)(value)


def main(argv):
    del argv
    f = flags.FLAGS
    STEPS, B, NKV, LR, PRE = f.steps, f.batch, f.pairs, f.lr, f.recall_steps
    d = hf_model_config().to_dict(); d["text_config"]["vocab_size"] = 128
    _override(d["text_config"], f.text)
    FILL, POST = f.filler, f.post_filler
    cfg = registry.config_from_hf_dict(d, RuntimeOptions(dtype="float32", param_dtype="float32"))
    model = registry.init_model(cfg, seed=f.seed)
    KEYS, VALS, BOS, SEP, VER, PASS, FAIL = np.arange(20, 40), np.arange(40, 60), 11, 12, 13, 14, 15
    rng = np.random.default_rng(f.seed)
    fixed_post = np.random.default_rng(f.seed + 1).integers(60, 128, POST)

    def batch(n, force_ok=False):
        ids, y, per_value = [], [], []
        for _ in range(n):
            if f.keyless:     # pool j: keys KEYS[j], values VALS[5j:5j+5]
                pools = rng.choice(len(VALS) // 5, NKV, replace=False)
                k = KEYS[pools]; v = np.array([rng.choice(VALS[5 * j:5 * j + 5]) for j in pools])
            else:
                k = rng.choice(KEYS, NKV, replace=False); v = rng.choice(VALS, NKV)
            q = rng.integers(NKV); ok = force_ok or rng.random() < 1.0 - f.fail_share
            pool_q = VALS[5 * pools[q]:5 * pools[q] + 5] if f.keyless else VALS
            vq = v[q] if ok else rng.choice([x for x in pool_q if x != v[q]])
            fill = rng.integers(60, 128, FILL)
            n_pre = int(rng.integers(0, FILL + 1)) if f.jitter else 0
            if f.keyless and f.distractors:   # before the stated values, as an earlier turn's
                fill[:f.distractors] = rng.choice(VALS, f.distractors)
                n_pre = max(n_pre, f.distractors)
            post = fixed_post if f.fixed_post else rng.integers(60, 128, POST)
            if f.echo_all:
                echo = v.copy(); echo[q] = vq
                order = rng.permutation(NKV) if f.shuffle_echo else np.arange(NKV)
                tail = np.stack([k[order], echo[order]], 1).ravel()
            else:
                tail = [k[q], vq]
            stated = np.stack([np.full(NKV, 60 + 67), v], 1).ravel() if f.keyless else np.stack([k, v], 1).ravel()
            ids.append([BOS, *fill[:n_pre], *stated, *fill[n_pre:], SEP, *tail, *post, VER])
            y.append(ok)
            per_value.append([ok or o != q for o in (order if f.echo_all else range(NKV))])
        return np.array(ids, np.int32), np.array(y), np.array(per_value)

    graphdef, state = nnx.split(model)
    if f.qk_gain != 1.0:
        def scale(path, x):
            names = "/".join(str(getattr(k, "key", k)) for k in path)
            return x * f.qk_gain if ("q_norm" in names or "k_norm" in names) else x
        state = jax.tree_util.tree_map_with_path(scale, state)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(optax.warmup_cosine_decay_schedule(0, LR, 20, STEPS + PRE)))
    ostate = opt.init(state)

    # the repeated values' positions, first to last (the last sits right before the post filler)
    value_pos = np.array([-2 - POST - 2 * (NKV - 1 - j) for j in range(NKV)])

    def loss_fn(state, inputs, y, per_value):
        out = nnx.merge(graphdef, state).forward_arrays(inputs)
        lg = out.logits_btv[:, -1, :][:, jnp.array([FAIL, PASS])]
        loss = optax.softmax_cross_entropy_with_integer_labels(lg, y.astype(jnp.int32)).mean()
        if f.value_loss and f.echo_all:
            lv = out.logits_btv[:, value_pos, :][..., jnp.array([FAIL, PASS])]
            loss = loss + f.value_loss * optax.softmax_cross_entropy_with_integer_labels(
                lv, per_value.astype(jnp.int32)).mean()
        return loss, (jax.nn.softmax(lg)[:, 1], jax.nn.softmax(out.logits_btv[:, value_pos, :][..., jnp.array([FAIL, PASS])])[..., 1])

    def recall_loss(state, inputs, ids):
        # the policy's objective: after each repeated key, write its value (next-token CE at the
        # keys' positions; the last value sits right before the post filler)
        out = nnx.merge(graphdef, state).forward_arrays(inputs)
        echoed = NKV if f.echo_all else 1
        pos = np.array([-3 - POST - 2 * j for j in range(echoed)])
        return optax.softmax_cross_entropy_with_integer_labels(out.logits_btv[:, pos, :], ids[:, pos + 1]).mean()

    @jax.jit
    def pre_step(state, ostate, inputs, ids):
        l, g = jax.value_and_grad(recall_loss)(state, inputs, ids)
        u, ostate = opt.update(g, ostate, state)
        return optax.apply_updates(state, u), ostate, l

    @jax.jit
    def step(state, ostate, inputs, y, per_value):
        (l, _), g = jax.value_and_grad(loss_fn, has_aux=True)(state, inputs, y, per_value)
        u, ostate = opt.update(g, ostate, state)
        return optax.apply_updates(state, u), ostate, l

    evalf = jax.jit(lambda s, i, y, pv: loss_fn(s, i, y, pv)[1])
    def value_auc(p_value):   # the per-value readout, over every repeated value
        return f" per-value AUC {roc_auc_score(vpv.ravel(), p_value.ravel()):.3f}" if f.value_loss and f.echo_all else ""
    vi, vy, vpv = batch(512); vin = prepare_inputs(cfg, vi)
    pool = batch(f.train_pool) if f.train_pool else None

    def train_batch():
        if pool is None:
            return batch(B)
        pick = rng.choice(f.train_pool, B, replace=False)
        return pool[0][pick], pool[1][pick], pool[2][pick]
    t0 = time.time()
    for s in range(1, PRE + 1):
        i, _, _ = batch(B, force_ok=True)     # passing sequences: the value written is the right one
        state, ostate, l = pre_step(state, ostate, prepare_inputs(cfg, i), jnp.asarray(i))
        if s % max(1, PRE // 5) == 0:
            print(f"recall step {s} loss {float(l):.3f} wall {time.time() - t0:.0f}s", flush=True)
    for s in range(1, STEPS + 1):
        i, y, pv = train_batch()
        state, ostate, l = step(state, ostate, prepare_inputs(cfg, i), jnp.asarray(y), jnp.asarray(pv))
        if s % max(1, STEPS // 10) == 0:
            p, p_value = map(np.asarray, evalf(state, vin, jnp.asarray(vy), jnp.asarray(vpv)))
            print(f"step {s} loss {float(l):.3f} heldout AUC {roc_auc_score(vy, p):.3f}{value_auc(p_value)} "
                  f"wall {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    app.run(main)
