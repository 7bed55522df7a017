"""Mixtures by EM on structinfer models: a Gaussian mixture, slot attention on a synthetic
scene, and switching linear dynamics segmentation (issue 7; Tschantz's log-sum-exp EM,
Singh & Buckley sec. 4.3).

Each E-step is the exact engine on a structinfer model (``structinfer.infer.gmm_em``,
``slot_em``, ``linear_mixture_em``; the responsibilities are the edge marginals), each
M-step closed form.

* **GMM**: 3 well-separated 2-D Gaussians (600 points); EM from 3 random data points.
  Recovered means / weights vs the truth (matched by the Hungarian algorithm), label
  accuracy of the MAP component, and the log-likelihood against scikit-learn's
  ``GaussianMixture`` started from the same means (an independent EM).
* **Slot attention**: a scene of 4 objects, each 40 "pixels" with features
  (x, y, r, g, b): positions around the object's centre, the object's colour plus noise.
  Slots are inferred by CCCP and ``W_K``, ``W_Q`` learned by weighted least squares
  (``slot_em``); the pixels' MAP slots are compared with the objects by the adjusted
  Rand index (ARI; 1 = perfect, 0 = chance). On this scene it does not separate the
  objects (see ``docs/reproductions.md``): it is reported, not asserted.
* **Switching linear dynamics**: a 2-D state switching between a slow rotation and a
  contracting shear, Markov switching with mean dwell 50 steps, T = 600. EM for the
  mixture of linear-Gaussian modes ``x_{t+1} ~ N(A_k x_t + b_k, Σ_k)`` (modes i.i.d. a
  priori: no transition model); segmentation accuracy of the MAP mode under the best
  relabelling.

The papers report no numbers for these (they derive the energies), so the checks are
against the simulated truth and scikit-learn.

    python examples/reproduce_mixtures.py            # full (5 seeds each)
    python examples/reproduce_mixtures.py --quick    # CI smoke run (1 seed)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from structinfer.infer import gmm_em, linear_mixture_em, slot_em


def best_permutation_accuracy(true, pred, k: int) -> float:
    best = 0.0
    for perm in itertools.permutations(range(k)):
        best = max(best, float(np.mean(np.asarray(perm)[pred] == true)))
    return best


def run_gmm(seed: int) -> dict:
    from scipy.optimize import linear_sum_assignment
    from sklearn.mixture import GaussianMixture

    rng = np.random.default_rng(seed)
    k, n = 3, 600
    means = np.array([[0.0, 0.0], [4.0, 1.0], [1.0, 4.5]])
    weights = np.array([0.5, 0.3, 0.2])
    covs = np.stack([np.array([[1.0, 0.3], [0.3, 0.6]]), np.diag([0.5, 1.2]), np.eye(2) * 0.7])
    z = rng.choice(k, n, p=weights)
    x = np.stack([rng.multivariate_normal(means[c], covs[c]) for c in z])
    init = x[rng.choice(n, k, replace=False)]
    run = jax.jit(lambda x, m: gmm_em(x, m, jnp.tile(jnp.eye(2), (k, 1, 1)), reg=1e-6, max_iters=200))
    st, info = run(jnp.asarray(x), jnp.asarray(init))
    e = np.asarray(info.energy)[: int(info.num_steps) + 1]
    mu = np.asarray(st.means)
    cost = ((mu[:, None] - means[None]) ** 2).sum(-1)
    r, c = linear_sum_assignment(cost)
    order = c[np.argsort(r)]  # recovered component i <-> true order[i]
    pred = np.asarray(order)[np.argmax(np.asarray(st.responsibilities), -1)]
    sk = GaussianMixture(k, covariance_type="full", means_init=init, weights_init=np.full(k, 1 / k),
                         precisions_init=np.tile(np.eye(2), (k, 1, 1)), reg_covar=1e-6, tol=1e-10,
                         max_iter=500).fit(x)
    return {
        "iterations": int(info.num_steps),
        "loglik_per_point": float(st.log_likelihood) / n,
        "sklearn_loglik_per_point": float(sk.score(x)),
        "loglik_monotone": bool(np.all(np.diff(e) <= 1e-6 * np.abs(e[1:]) + 1e-6)),
        "max_mean_error": float(np.sqrt(cost[r, c]).max()),
        "weights_recovered": [float(np.asarray(st.weights)[i]) for i in np.argsort(order)],
        "weights_true": weights.tolist(),
        "label_accuracy": float(np.mean(pred == z)),
    }


def run_slots(seed: int) -> dict:
    from sklearn.metrics import adjusted_rand_score

    rng = np.random.default_rng(seed)
    k, per = 4, 40
    centres = rng.uniform(-1, 1, (k, 2)) * 2.0
    colours = np.eye(3)[rng.permutation(np.r_[0:3, rng.integers(0, 3)])] * 2.0  # 4 objects, 3 hues
    colours[-1] = colours[-1] * 0.5 + 0.5  # the 4th object: a lighter shade of a hue
    labels = np.repeat(np.arange(k), per)
    pos = centres[labels] + 0.3 * rng.normal(size=(k * per, 2))
    col = colours[labels] + 0.1 * rng.normal(size=(k * per, 3))
    x = np.concatenate([pos, col], 1)
    x = (x - x.mean(0)) / x.std(0)
    slots0 = 0.1 * rng.normal(size=(k, 5)) + x[rng.choice(k * per, k, replace=False)]
    wk = np.eye(5) + 0.01 * rng.normal(size=(5, 5))
    wq = np.eye(5) + 0.01 * rng.normal(size=(5, 5))
    run = jax.jit(lambda *a: slot_em(*a, e_iters=20, max_iters=30, raise_on_nonfinite=False))
    st, info = run(jnp.asarray(x), jnp.asarray(slots0), jnp.asarray(wk), jnp.asarray(wq))
    att = np.asarray(st.attention)
    pred = np.argmax(att, -1)
    return {"ari": float(adjusted_rand_score(labels, pred)),
            "attention_rows_sum_to_one": bool(np.allclose(att.sum(-1), 1.0, atol=1e-6)),
            "slots_used": int(len(np.unique(pred))), "iterations": int(info.num_steps)}


def run_slds(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    T, k = 600, 2
    th = 0.15
    A = np.stack([0.99 * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]]),
                  np.array([[0.9, 0.3], [0.0, 0.8]])])
    b = np.array([[0.0, 0.0], [0.5, -0.3]])
    stay = 1 - 1 / 50
    z = np.zeros(T - 1, int)
    for t in range(1, T - 1):
        z[t] = z[t - 1] if rng.random() < stay else 1 - z[t - 1]
    xs = np.zeros((T, 2))
    xs[0] = rng.normal(size=2)
    for t in range(T - 1):
        xs[t + 1] = A[z[t]] @ xs[t] + b[z[t]] + 0.05 * rng.normal(size=2)
    A0 = np.stack([np.eye(2) + 0.1 * rng.normal(size=(2, 2)) for _ in range(k)])
    run = jax.jit(lambda u, y, A0: linear_mixture_em(
        u, y, A0, jnp.zeros((k, 2)), jnp.tile(jnp.eye(2) * 0.1, (k, 1, 1)), reg=1e-6, max_iters=200))
    st, info = run(jnp.asarray(xs[:-1]), jnp.asarray(xs[1:]), jnp.asarray(A0))
    pred = np.argmax(np.asarray(st.responsibilities), -1)
    acc = best_permutation_accuracy(z, pred, k)
    perm = max(itertools.permutations(range(k)), key=lambda p: np.mean(np.asarray(p)[pred] == z))
    A_err = max(float(np.abs(np.asarray(st.A)[i] - A[perm[i]]).max()) for i in range(k))
    return {"segmentation_accuracy": acc, "max_abs_A_error": A_err, "iterations": int(info.num_steps),
            "num_switches": int(np.sum(np.diff(z) != 0))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run: one seed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("results/mixtures"))
    cfg = ap.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    if cfg.quick:
        cfg.seeds = 1
    seeds = [cfg.seed + s for s in range(cfg.seeds)]
    t0 = time.time()
    res = {"gmm": [run_gmm(s) for s in seeds], "slots": [run_slots(s) for s in seeds],
           "slds": [run_slds(s) for s in seeds]}
    res["seconds"] = time.time() - t0

    def col(part, key):
        return np.array([r[key] for r in res[part]], float)

    print(f"{'experiment':34s} {'metric':28s} {'mean':>8s} {'min':>8s}")
    rows = [("GMM (EM)", "gmm", "label_accuracy"), ("GMM (EM)", "gmm", "max_mean_error"),
            ("GMM: ours - sklearn loglik/pt", None, None),
            ("slot attention (slot_em)", "slots", "ari"),
            ("switching linear dynamics", "slds", "segmentation_accuracy"),
            ("switching linear dynamics", "slds", "max_abs_A_error")]
    for name, part, key in rows:
        if part is None:
            v = col("gmm", "loglik_per_point") - col("gmm", "sklearn_loglik_per_point")
            print(f"{name:34s} {'difference':28s} {v.mean():8.2e} {v.min():8.2e}")
            continue
        v = col(part, key)
        print(f"{name:34s} {key:28s} {v.mean():8.3f} {v.min():8.3f}")

    for r in res["gmm"]:
        assert r["loglik_monotone"], r
        assert r["label_accuracy"] > 0.8, r
        assert abs(r["loglik_per_point"] - r["sklearn_loglik_per_point"]) < 1e-3, r
    for r in res["slds"]:
        assert r["segmentation_accuracy"] > 0.8, r
    for r in res["slots"]:
        # reported, not asserted: on this scene slot_em collapses onto one slot (see docs)
        assert r["attention_rows_sum_to_one"], r
    if not cfg.quick:
        cfg.out.mkdir(parents=True, exist_ok=True)
        res["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()}
        (cfg.out / "results.json").write_text(json.dumps(res, indent=1))
        print(f"wrote {cfg.out}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
