"""Expanding attention vs self attention (Singh & Buckley sec. 5.2, appendix 9, Figure 3).

Data (appendix 9): ``n = 50`` tokens of dimension ``d ∈ {10, 50}``, σ² = 0.1. As in
the multi-hop task but without ``x_0``: ``x_1 ~ N(0, σ² I)``, ``x_2 = W_r x_1 + N(0, σ² I)``,
``y = W_y x_1``; the other tokens are noise. ``x_2`` is the query, at the final position;
``x_1`` sits ``D ~ Geometric(p)`` positions before it (``D ≥ 1``, clipped to the start),
``p ∈ {0.5, 0.2, 0.1, 0.04}`` — the recency bias. No model may attend to the final
token, so the query's parents are the 49 earlier tokens.

Models, each a structinfer model for the query's edge ``φ`` (bilinear score, value
``W_v x_φ``):

* self attention: ``φ ~ Uniform(49 earlier tokens)``;
* expanding attention: ``φ ~ Geometric(q)`` on the distance back from the query with
  ``q ~ Beta(α = 0.1, β = 0.9)``. ``q`` is inferred per input by the plug-in mean-field
  loop of Algorithm 3 (``structinfer.infer.geometric_beta(method="plugin")``): window
  ``H_t = ⌈ln 0.05 / ln(1 - q_t)⌉``, ``α ← α + 1``, ``β ← β + Σ_{k<H} k A_k``. The output is
  the expectation of the value under the model's edge posterior at the final ``q_T``
  with the prior truncated to the final window ``H_T`` (``si.expectation``). Gradients
  flow through the scores and values; ``q_T`` and ``H_T`` are held fixed (the loop is
  not differentiated), which is the posterior the network is trained through.

Training (appendix 9): batch size 1, 10000 Adam steps at learning rate 5e-4 (full
mode); losses are per-step squared errors, plotted as a running mean, and each model
is evaluated on 1000 held-out sequences. ``W_r`` is ``rand(d, 2) @ rand(2, d)``
rescaled to spectral norm ``--wr-norm`` and ``W_y = rand(d)`` to unit norm (the paper
states no scales; the same choice as ``structinfer.reproductions.multihop``).

Operation counts (sec. 5.2: ``O(n² d)`` for attention vs ``O(n(m d + k))`` for
expanding, ``m`` the window at convergence, ``k`` the number of steps): per query,
dense attention scores 49 parents, ``49·d`` multiply-adds. Expanding attention
computes (and caches) the dot products of the largest window it visits, ``max_t H_t · d``,
plus ``Σ_t H_t`` for the softmaxes of its iterations. We also report the count without
caching, ``Σ_t H_t · d``. The windows ``H_t`` of every iteration are recovered by
replaying the plug-in recurrence for the number of steps the library loop took; the
replay is checked to end at the library's attention and window.

    structinfer reproduce expanding            # 8 settings × 2 models × 10000 steps
    structinfer reproduce expanding --quick    # CI smoke run (one setting)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import optax
from jax.typing import ArrayLike

import structinfer as si
from structinfer.infer import GeoBetaState, LoopInfo, geometric_beta, horizon

N_TOKENS, SIGMA2, ALPHA0, BETA0 = 50, 0.1, 0.1, 0.9
NP = N_TOKENS - 1  # parents of the query: the 49 earlier tokens
MODELS = ("self_attention", "expanding")


# --------------------------------------------------------------------------- data
def make_task(key: jax.Array, d: int, wr_norm: float, rank: int = 2) -> tuple[jax.Array, jax.Array]:
    """``W_r``, a rank-``rank`` product rescaled to spectral norm ``wr_norm``, and a unit-norm ``W_y``."""
    k1, k2, k3 = jax.random.split(key, 3)
    wr = jax.random.uniform(k1, (d, rank)) @ jax.random.uniform(k2, (rank, d))
    wr = wr * (wr_norm / jnp.linalg.norm(wr, ord=2))
    wy = jax.random.uniform(k3, (d,))
    return wr, wy / jnp.linalg.norm(wy)


def sample_sequences(
    key: jax.Array, wr: jax.Array, wy: jax.Array, num: int, p: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(num, n, d)`` sequences, targets ``(num,)`` and the distance of x_1 from the query."""
    d = wr.shape[0]
    kx, k1, k2, kd = jax.random.split(key, 4)
    sd = SIGMA2**0.5
    noise = sd * jax.random.normal(kx, (num, NP, d))
    x1 = sd * jax.random.normal(k1, (num, d))
    x2 = x1 @ wr.T + sd * jax.random.normal(k2, (num, d))
    # D ~ Geometric(p) on {1, 2, ...}, clipped to the first position
    u = jax.random.uniform(kd, (num,), minval=1e-12)
    dist = jnp.minimum(jnp.floor(jnp.log(u) / math.log1p(-p)).astype(jnp.int32) + 1, NP)
    # x_1 at position NP - D, noise elsewhere, the query x_2 last
    at = (jnp.arange(NP)[None, :] == (NP - dist)[:, None])[..., None]
    seq = jnp.concatenate([jnp.where(at, x1[:, None, :], noise), x2[:, None]], 1)
    return seq, x1 @ wy, dist


# --------------------------------------------------------------------------- models
def query_scores(seq: jax.Array, params: dict[str, jax.Array]) -> si.scores.Bilinear:
    """Bilinear scores of the query (final token) against the 49 earlier tokens, ``(1, 49)``."""
    xq, xk = seq[-1:], seq[:-1]
    return si.scores.Bilinear(xq, xk, params["wq"], params["wk"], scale=params["wq"].shape[0] ** -0.5)


def self_attention_model(seq: jax.Array, params: dict[str, jax.Array]) -> None:
    """The query's edge over the 49 earlier tokens, uniform prior."""
    with numpyro.plate("query", 1):
        j = si.edge("phi", si.priors.Uniform(NP), query_scores(seq, params))
        numpyro.deterministic("out", (seq[:-1] @ params["wv"].T)[j])


def expanding_model(
    seq: jax.Array, params: dict[str, jax.Array], q: jax.Array, window: jax.Array
) -> None:
    r"""The query's edge with the geometric prior at rate ``q``, truncated to ``window`` steps.

    ``p(φ = j | q) ∝ q (1-q)^{d_j - 1}`` for distance ``d_j = 49 - j + 1 ≥ 1`` and ``d_j ≤ H``.
    Forbidden (out-of-window) edges get the row's smallest score, which changes
    nothing (their prior is zero); it kept the engine's log-space sums from
    underflowing when such an edge scored far above the window (float32), before the
    engine folded an edge's score into its prior's factor.
    """
    s = query_scores(seq, params).dense()
    dist = NP - jnp.arange(NP)  # distance of parent j from the query: 49 .. 1
    inside = dist <= window
    s = jnp.where(inside, s, jnp.min(s, -1, keepdims=True))
    prior = si.priors.Geometric(q, NP, include_self=False, offset=NP, max_distance=window)
    with numpyro.plate("query", 1):
        j = si.edge("phi", prior, si.scores.Custom(s))
        numpyro.deterministic("out", (seq[:-1] @ params["wv"].T)[j])


def infer_rate(scores: jax.Array, max_iters: int) -> tuple[GeoBetaState, LoopInfo]:
    """Algorithm 3 (plug-in mean field) on the query's cached scores ``(1, 49)``."""
    state, info = geometric_beta(
        jax.lax.stop_gradient(scores), ALPHA0, BETA0, method="plugin",
        include_self=False, offset=NP, max_iters=max_iters, raise_on_nonfinite=False,
    )
    return state, info


def predict(
    name: str, params: dict[str, jax.Array], seq: jax.Array, max_iters: int
) -> tuple[jax.Array, tuple[GeoBetaState, LoopInfo] | None]:
    """Prediction at the query, plus (expanding) the mean-field state and loop info."""
    if name == "self_attention":
        return si.expectation(self_attention_model, "out", seq, params)[0, 0], None
    state, info = infer_rate(query_scores(seq, params).dense(), max_iters)
    q, window = state.mean_q[0], state.window[0]
    y = si.expectation(expanding_model, "out", seq, params, q, window)[0, 0]
    return y, (state, info)


def replay_windows(
    scores: jax.Array, num_steps: jax.Array, max_iters: int
) -> tuple[jax.Array, jax.Array]:
    """Windows ``H_0 .. H_T`` of the plug-in recurrence, replayed for ``num_steps`` steps.

    Returns the windows ``(max_iters + 1,)`` (0 after the last step) and the final
    attention, to be compared with the library's.
    """
    s = scores[0]
    k = (NP - jnp.arange(NP) - 1).astype(s.dtype)  # steps back from the nearest parent

    def attend(a, b):
        q = a / (a + b)
        h = horizon(q)
        logits = jnp.where(k < h, s + k * jnp.log1p(-q), -jnp.inf)
        return jax.nn.softmax(logits), h

    def body(carry, t):
        a, b, att, h = carry
        a2, b2 = a + 1.0, b + jnp.sum(att * k)
        att2, h2 = attend(a2, b2)
        go = t < num_steps
        new = (jnp.where(go, a2, a), jnp.where(go, b2, b), jnp.where(go, att2, att), jnp.where(go, h2, h))
        return new, jnp.where(go, h2, 0.0)

    att0, h0 = attend(jnp.asarray(ALPHA0, s.dtype), jnp.asarray(BETA0, s.dtype))
    (_, _, att, _), hs = jax.lax.scan(body, (ALPHA0 + 0 * s[0], BETA0 + 0 * s[0], att0, h0),
                                      jnp.arange(max_iters))
    return jnp.concatenate([h0[None], hs]), att


def init_params(key: jax.Array, d: int) -> dict[str, jax.Array]:
    """``W_Q``, ``W_K`` ``(d, d)`` and ``W_V`` ``(1, d)``, normal with variance ``1/d``."""
    ks = jax.random.split(key, 3)
    nrm = lambda k, shape: jax.random.normal(k, shape) / d**0.5
    return {"wq": nrm(ks[0], (d, d)), "wk": nrm(ks[1], (d, d)), "wv": nrm(ks[2], (1, d))}


# --------------------------------------------------------------------------- experiment
def run_setting(d: int, p: float, cfg: argparse.Namespace, seed: int) -> dict:
    """Train and evaluate both models on one setting ``(d, p)``."""
    key = jax.random.PRNGKey(seed)
    k_task, k_train, k_test, k_init = jax.random.split(key, 4)
    wr, wy = jax.jit(make_task, static_argnums=(1, 2))(k_task, d, cfg.wr_norm)
    sample = jax.jit(sample_sequences, static_argnums=(3, 4))
    xtr, ytr, _ = sample(k_train, wr, wy, cfg.steps, p)
    xte, yte, dte = sample(k_test, wr, wy, cfg.test_size, p)
    out = {"d": d, "p": p}
    for name in MODELS:
        params = init_params(k_init, d)  # both models start from the same weights
        opt = optax.adam(cfg.lr)

        def loss_fn(prm, x, y):
            return (predict(name, prm, x, cfg.max_iters)[0] - y) ** 2

        def step(carry, batch):
            prm, st = carry
            loss, g = jax.value_and_grad(loss_fn)(prm, *batch)
            upd, st = opt.update(g, st, prm)
            return (optax.apply_updates(prm, upd), st), loss

        train = jax.jit(lambda c: jax.lax.scan(step, c, (xtr, ytr)))
        (params, _), losses = train((params, opt.init(params)))
        losses = np.asarray(losses)

        @jax.jit
        def evaluate(prm):
            def one(x, y):
                pred, extra = predict(name, prm, x, cfg.max_iters)
                res = {"sq": (pred - y) ** 2}
                if extra is not None:
                    state, info = extra
                    scores = query_scores(x, prm).dense()
                    hs, att = replay_windows(scores, info.num_steps[0], cfg.max_iters)
                    res.update(
                        window=state.window[0], steps=info.num_steps[0],
                        converged=info.converged[0], mean_q=state.mean_q[0],
                        sum_h=jnp.sum(hs), max_h=jnp.max(hs),
                        replay_err=jnp.max(jnp.abs(att - state.attention[0])),
                        replay_window_ok=hs[info.num_steps[0]] == state.window[0],
                    )
                return res

            return jax.vmap(one)(xte, yte)

        ev = {k: np.asarray(v) for k, v in evaluate(params).items()}
        rec = {
            # per-step squared errors averaged over blocks of `curve_every` steps
            "train_curve": block_means(losses, cfg.curve_every).tolist(),
            "curve_every": cfg.curve_every,
            "test_mse": float(ev["sq"].mean()),
            "test_rel_mse": float(ev["sq"].mean() / np.var(np.asarray(yte))),
        }
        if name == "expanding":
            dense_ops = NP * d
            rec.update(
                mean_window=float(ev["window"].mean()),
                mean_steps=float(ev["steps"].mean()),
                frac_converged=float(ev["converged"].mean()),
                mean_q=float(ev["mean_q"].mean()),
                ops_cached=float(np.mean(ev["max_h"] * d + ev["sum_h"])),
                ops_uncached=float(np.mean(ev["sum_h"] * d)),
                dense_ops=dense_ops,
                rel_ops_cached=float(np.mean(ev["max_h"] * d + ev["sum_h"]) / dense_ops),
                rel_ops_uncached=float(np.mean(ev["sum_h"] * d) / dense_ops),
                window_covers_x1=float(np.mean(np.asarray(dte) <= ev["window"])),
                replay_max_err=float(ev["replay_err"].max()),
                replay_windows_match=bool(ev["replay_window_ok"].all()),
            )
        out[name] = rec
    return out


def check_model_matches_library(seed: int = 3) -> float:
    """The expanding model's edge posterior at (q_T, H_T) equals geometric_beta's attention."""
    d = 10
    params = init_params(jax.random.PRNGKey(seed), d)
    params = jax.tree.map(lambda a: 3.0 * a, params)
    wr, wy = jax.jit(make_task, static_argnums=(1, 2))(jax.random.PRNGKey(seed + 1), d, 4.0)
    seq, _, _ = jax.jit(sample_sequences, static_argnums=(3, 4))(jax.random.PRNGKey(seed + 2), wr, wy, 1, 0.2)

    @jax.jit
    def diff(seq, params):
        state, _ = infer_rate(query_scores(seq, params).dense(), 100)
        marg = si.marginals(expanding_model, seq, params, state.mean_q[0], state.window[0])["phi"]
        return jnp.max(jnp.abs(marg - state.attention))

    return float(diff(seq[0], params))


def block_means(x: ArrayLike, w: int) -> np.ndarray:
    """Means over consecutive blocks of ``w`` steps (the last partial block dropped)."""
    x = np.asarray(x, float)
    w = max(1, min(w, len(x)))
    return x[: len(x) // w * w].reshape(-1, w).mean(1)


def plot(results: dict, out: Path) -> None:
    """Training curves and relative operation counts, as PNGs in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = results["settings"]
    ds = sorted({s["d"] for s in settings})
    ps = sorted({s["p"] for s in settings}, reverse=True)
    fig, axes = plt.subplots(len(ds), len(ps), figsize=(3.2 * len(ps), 2.6 * len(ds)), squeeze=False)
    for s in settings:
        ax = axes[ds.index(s["d"]), ps.index(s["p"])]
        for name, c in zip(MODELS, ("tab:blue", "tab:red")):
            curve = np.asarray(s[name]["train_curve"])
            ax.plot(np.arange(1, len(curve) + 1) * s[name]["curve_every"], curve, color=c, label=name, lw=1)
        ax.set_yscale("log")
        ax.set_title(f"d={s['d']}, p={s['p']}", fontsize=9)
    axes[0, 0].legend(fontsize=7)
    fig.supxlabel("step (batch size 1)")
    fig.supylabel("squared error (mean per block of steps)")
    fig.tight_layout()
    fig.savefig(out / "training_curves.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for d, mk in zip(ds, ("o", "s", "^")):
        rows = sorted((s for s in settings if s["d"] == d), key=lambda s: s["p"])
        xs = [1 / s["p"] for s in rows]
        ax.plot(xs, [s["expanding"]["rel_ops_cached"] for s in rows], marker=mk, label=f"d={d} (cached)")
        ax.plot(xs, [s["expanding"]["rel_ops_uncached"] for s in rows], marker=mk, ls="--",
                label=f"d={d} (uncached)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("1 / p (mean distance of x_1)")
    ax.set_ylabel("operations relative to self attention")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "relative_operations.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the reproduction from the command line (``argv``); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run: one setting, few steps")
    ap.add_argument("--no-progress", action="store_true",
                    help="hide progress bars (this one shows none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10000, help="Adam steps (batch size 1)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--dims", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--ps", type=float, nargs="+", default=[0.5, 0.2, 0.1, 0.04])
    ap.add_argument("--test-size", type=int, default=1000)
    ap.add_argument("--curve-every", type=int, default=100, help="steps per point of the stored curve")
    ap.add_argument("--max-iters", type=int, default=100, help="mean-field iterations at most")
    ap.add_argument("--wr-norm", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=Path("results/expanding"))
    cfg = ap.parse_args(argv)
    if cfg.quick:
        cfg.steps, cfg.dims, cfg.ps, cfg.test_size, cfg.max_iters = 400, [10], [0.2], 100, 50
        cfg.curve_every = 20

    err = check_model_matches_library()
    print(f"expanding model posterior vs geometric_beta attention: max |diff| = {err:.2e}")
    assert err < 1e-5, err

    t0 = time.time()
    settings = []
    for d in cfg.dims:
        for p in cfg.ps:
            settings.append(run_setting(d, p, cfg, cfg.seed))
            print(f"  d={d:3d} p={p:<5} done ({time.time() - t0:.0f} s)", flush=True)

    print(f"\n{'d':>3s} {'p':>5s} {'self MSE':>9s} {'exp MSE':>9s} {'window':>7s} {'steps':>6s}"
          f" {'covers x1':>9s} {'rel ops':>8s} {'(uncached)':>10s}")
    for s in settings:
        e = s["expanding"]
        print(f"{s['d']:3d} {s['p']:5.2f} {s['self_attention']['test_mse']:9.4f} {e['test_mse']:9.4f}"
              f" {e['mean_window']:7.1f} {e['mean_steps']:6.1f} {e['window_covers_x1']:9.2f}"
              f" {e['rel_ops_cached']:8.3f} {e['rel_ops_uncached']:10.3f}")

    for s in settings:
        e = s["expanding"]
        assert e["replay_windows_match"] and e["replay_max_err"] < 1e-4, e["replay_max_err"]
        for name in MODELS:
            lo = np.asarray(s[name]["train_curve"])
            k = max(len(lo) // 4, 1)
            assert lo[-k:].mean() < lo[:k].mean(), (name, lo[:k].mean(), lo[-k:].mean())

    if not cfg.quick:
        cfg.out.mkdir(parents=True, exist_ok=True)
        res = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
               "model_vs_library_max_abs_diff": err, "settings": settings,
               "seconds": time.time() - t0}
        (cfg.out / "results.json").write_text(json.dumps(res))
        plot(res, cfg.out)
        print(f"wrote {cfg.out}/results.json, training_curves.png, relative_operations.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
