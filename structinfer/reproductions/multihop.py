"""Multi-hop attention on the toy task of Singh & Buckley sec. 5.1 / appendix 9 (Figure 2).

Data (appendix 9): ``n = 10`` tokens of dimension ``d = 10``. A low-rank relation
``W_r`` generates a chain ``x_0 -> x_1 -> x_2`` with ``x_{i+1} = W_r x_i + N(0, σ² I)``,
σ² = 1; the other 7 tokens are pure noise; the target is ``y = W_y (x_1 + x_0)``.

Our reading of the query / final-token setting (the paper leaves it implicit):

* ``x_2`` is the *query*: it is the final token (position 9) and the output is read
  there. ``y`` is "generated from the history of ``x_2``", so the model must find
  ``x_2``'s parent ``x_1`` and, for the second term, ``x_1``'s parent ``x_0``.
* the remaining nine tokens (``x_0``, ``x_1`` and 7 noise tokens) are shuffled into
  positions 0..8, so position carries no information.
* "all models were prevented from self-attending to the final token": no node may
  take the final token as its parent (its column of the structural prior is zero),
  which also stops the query from attending to itself. We also remove every other
  self-edge (``φ_i ≠ i``), reading "self-attending" literally: with ``W_r`` built from
  non-negative ``torch.rand`` entries, ``x_1ᵀ A x_1`` is large for the learned
  ``A ≈ W_r`` and the second hop returns to ``x_1`` instead of reaching ``x_0``
  (``--self-edges`` restores them, as an ablation).

Three models, each a structinfer model (edge sites with a ``Restricted`` prior, a
bilinear score and a linear value), trained by exact expectation (``si.expectation``):

* one-layer self attention: ``ŷ = E[W_v x_φ]`` at the query;
* two-layer self attention: ``h = x + E[V_1 x_φ]`` (layer 1, residual), then
  ``ŷ = E[W_v h_φ']`` at the query (layer 2, its own W_Q, W_K);
* multi-hop (Algorithm 2, two hops): ``ŷ = E[W_v x_{φ_q} + W_v x_{φ_{φ_q}}] = (P + P²) V X``
  with the second edge written as ``si.edge(..., child=j)`` — same parameter count as
  one layer.

Training: batch size 200, Adam, learning rate 1e-3, 10 seeds (each seed draws its own
``W_r``, ``W_y``, data and initialisation). The paper's "number of batches: 10" is
read as the size of the training set (10 batches of 200 = 2000 sequences), trained
for ``--epochs`` passes (default 100, i.e. 1000 Adam steps — where our loss curves
have flattened; longer runs over-fit the 2000 sequences); losses are reported on
2000 held-out sequences. ``W_r`` is ``rand(d, r) @ rand(r, d)`` (``torch.rand``-style
uniform entries, rank ``r = 2``) rescaled to spectral norm ``--wr-norm`` so that the
chain neither vanishes nor explodes; ``W_y`` is ``rand(d)`` rescaled to unit norm.
The paper states neither scale.

    structinfer reproduce multihop            # full run (10 seeds), a few minutes
    structinfer reproduce multihop --quick    # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import optax

import structinfer as si

N_TOKENS, DIM, SIGMA2 = 10, 10, 1.0
MODELS = ("one_layer", "two_layer", "multihop")


# --------------------------------------------------------------------------- data
def make_task(key: jax.Array, d: int, rank: int, wr_norm: float) -> tuple[jax.Array, jax.Array]:
    """Draw the relation ``W_r`` (low rank) and the read-out ``W_y`` of one seed."""
    k1, k2, k3 = jax.random.split(key, 3)
    wr = jax.random.uniform(k1, (d, rank)) @ jax.random.uniform(k2, (rank, d))
    wr = wr * (wr_norm / jnp.linalg.norm(wr, ord=2))
    wy = jax.random.uniform(k3, (d,))
    return wr, wy / jnp.linalg.norm(wy)


def sample_sequences(
    key: jax.Array,
    wr: jax.Array,
    wy: jax.Array,
    num: int,
    n: int = N_TOKENS,
    sigma2: float = SIGMA2,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``num`` sequences ``(num, n, d)``, targets ``(num,)`` and the positions of x_0, x_1.

    Positions 0..n-2 hold x_0, x_1 and the noise tokens in a random order; position
    n-1 holds the query x_2.
    """
    d = wr.shape[0]
    kx, kp = jax.random.split(key)
    sd = sigma2**0.5
    eps = sd * jax.random.normal(kx, (num, n, d))
    x0 = eps[:, 0]
    x1 = x0 @ wr.T + eps[:, 1]
    x2 = x1 @ wr.T + eps[:, 2]
    context = jnp.concatenate([x0[:, None], x1[:, None], eps[:, 3:]], axis=1)  # (num, n-1, d)
    perm = jax.vmap(lambda k: jax.random.permutation(k, n - 1))(jax.random.split(kp, num))
    shuffled = jnp.take_along_axis(context, perm[..., None], axis=1)
    x = jnp.concatenate([shuffled, x2[:, None]], axis=1)
    pos = jnp.argsort(perm, axis=-1)  # pos[b, t] = where token t of `context` went
    y = (x1 + x0) @ wy
    return x, y, pos[:, 0], pos[:, 1]


# --------------------------------------------------------------------------- models
#: allow self-edges phi_i = i (set by --self-edges; off by default, see the module docstring)
SELF_EDGES = False


def parent_mask(n: int, self_edges: bool | None = None) -> np.ndarray:
    """No node may take the final token (the query) as parent, nor (by default) itself."""
    self_edges = SELF_EDGES if self_edges is None else self_edges
    mask = np.ones((n, n), bool)
    if not self_edges:
        mask &= ~np.eye(n, dtype=bool)
    mask[:, -1] = False
    return mask


def bilinear_score(x: jax.Array, wq: jax.Array, wk: jax.Array, mask: np.ndarray) -> si.scores.Custom:
    r"""``ψ_ij = x_iᵀ W_Qᵀ W_K x_j / √d_k`` with forbidden edges set to the row minimum.

    The prior already gives forbidden edges probability zero, so their score value
    does not change any result; clamping it kept the engine's log-space contraction
    from underflowing when a forbidden edge scored ~90 above every allowed one
    (float32: ``log Z = -inf`` and NaN marginals), before the engine folded an edge's
    score into its prior's factor; it is kept, and changes nothing.
    """
    s = si.scores.Bilinear(x, x, wq, wk, scale=wq.shape[0] ** -0.5).dense()
    floor = jnp.min(s, axis=-1, keepdims=True)
    return si.scores.Custom(jnp.where(mask, s, floor))


def attention_layer(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array) -> None:
    """One self-attention layer as a structinfer model (site ``phi``, value ``out``)."""
    n = x.shape[0]
    mask = parent_mask(n)
    with numpyro.plate("nodes", n):
        j = si.edge("phi", si.priors.Restricted(mask), bilinear_score(x, wq, wk, mask))
        numpyro.deterministic("out", (x @ wv.T)[j])


def multihop_model(
    x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array, hops: int = 2
) -> None:
    """Multi-hop attention: hop ``h+1`` is the edge of the node hop ``h`` reached."""
    n = x.shape[0]
    mask = parent_mask(n)
    prior = si.priors.Restricted(mask)
    score = bilinear_score(x, wq, wk, mask)
    values = x @ wv.T
    with numpyro.plate("nodes", n):
        j = si.edge("hop1", prior, score)
        out = values[j]
        for h in range(2, hops + 1):
            j = si.edge(f"hop{h}", prior, score, child=j)
            out = out + values[j]
        numpyro.deterministic("out", out)


def init_params(key: jax.Array, name: str, d: int) -> dict[str, jax.Array]:
    """The projections of model ``name``, normal with variance ``1/d``."""
    ks = jax.random.split(key, 6)
    nrm = lambda k, shape: jax.random.normal(k, shape) / d**0.5
    if name == "two_layer":
        return {
            "wq1": nrm(ks[0], (d, d)), "wk1": nrm(ks[1], (d, d)), "wv1": nrm(ks[2], (d, d)),
            "wq2": nrm(ks[3], (d, d)), "wk2": nrm(ks[4], (d, d)), "wv2": nrm(ks[5], (1, d)),
        }
    return {"wq": nrm(ks[0], (d, d)), "wk": nrm(ks[1], (d, d)), "wv": nrm(ks[2], (1, d))}


def predict_one(
    name: str, params: dict[str, jax.Array], x: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Prediction at the query (final token) and the query's attention rows."""
    if name == "one_layer":
        a = (x, params["wq"], params["wk"], params["wv"])
        y = si.expectation(attention_layer, "out", *a)[-1, 0]
        return y, {"phi": si.marginals(attention_layer, *a)["phi"][-1]}
    if name == "multihop":
        a = (x, params["wq"], params["wk"], params["wv"])
        y = si.expectation(multihop_model, "out", *a)[-1, 0]
        m = si.marginals(multihop_model, *a)
        return y, {"hop1": m["hop1"][-1], "hop2": m["hop2"][-1]}
    a1 = (x, params["wq1"], params["wk1"], params["wv1"])
    h = x + si.expectation(attention_layer, "out", *a1)
    a2 = (h, params["wq2"], params["wk2"], params["wv2"])
    y = si.expectation(attention_layer, "out", *a2)[-1, 0]
    return y, {
        "layer2": si.marginals(attention_layer, *a2)["phi"][-1],
        "layer1": si.marginals(attention_layer, *a1)["phi"],
    }


def predict_y(name: str, params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Only the prediction (what the training loss needs: no marginals)."""
    if name == "one_layer":
        return si.expectation(attention_layer, "out", x, params["wq"], params["wk"], params["wv"])[-1, 0]
    if name == "multihop":
        return si.expectation(multihop_model, "out", x, params["wq"], params["wk"], params["wv"])[-1, 0]
    h = x + si.expectation(attention_layer, "out", x, params["wq1"], params["wk1"], params["wv1"])
    return si.expectation(attention_layer, "out", h, params["wq2"], params["wk2"], params["wv2"])[-1, 0]


# --------------------------------------------------------------------------- training
def seed_data(seed: int, cfg: argparse.Namespace) -> dict:
    """One seed's task, training set ``(batches, batch, n, d)`` and test set."""
    k_task, k_train, k_test, k_init = jax.random.split(jax.random.PRNGKey(seed), 4)
    wr, wy = make_task(k_task, DIM, cfg.rank, cfg.wr_norm)
    xtr, ytr, _, _ = sample_sequences(k_train, wr, wy, cfg.batches * cfg.batch_size)
    xte, yte, p0, p1 = sample_sequences(k_test, wr, wy, cfg.test_size)
    return {
        "xtr": xtr.reshape(cfg.batches, cfg.batch_size, N_TOKENS, DIM),
        "ytr": ytr.reshape(cfg.batches, cfg.batch_size),
        "xte": xte, "yte": yte, "p0": p0, "p1": p1, "k_init": k_init,
    }


def train_all_seeds(name: str, data: dict, cfg: argparse.Namespace) -> list[dict]:
    """Train one model on every seed at once (``vmap`` over seeds, ``scan`` over batches)."""
    params = jax.vmap(lambda k: init_params(k, name, DIM))(data["k_init"])
    opt = optax.adam(cfg.lr)

    def loss_fn(p, x, y):
        pred = jax.vmap(lambda xi: predict_y(name, p, xi))(x)
        return jnp.mean((pred - y) ** 2)

    def one_epoch(p, s, xtr, ytr):
        def step(carry, batch):
            p, s = carry
            loss, g = jax.value_and_grad(loss_fn)(p, *batch)
            upd, s = opt.update(g, s, p)
            return (optax.apply_updates(p, upd), s), loss

        (p, s), losses = jax.lax.scan(step, (p, s), (xtr, ytr))
        return p, s, jnp.mean(losses)

    epoch = jax.jit(jax.vmap(one_epoch))
    state = jax.vmap(opt.init)(params)
    curves = []
    for _ in range(cfg.epochs):
        params, state, loss = epoch(params, state, data["xtr"], data["ytr"])
        curves.append(np.asarray(loss))
    curves = np.stack(curves, -1)  # (seeds, epochs)

    @jax.jit
    @jax.vmap
    def evaluate(p, xte, yte, p0, p1):
        pred, att = jax.vmap(lambda xi: predict_one(name, p, xi))(xte)
        rows = jnp.arange(xte.shape[0])
        mass = {}
        for k, a in att.items():
            if k == "layer1":  # how the x_1 token attends to x_0 in layer 1
                mass["layer1_x1_to_x0"] = jnp.mean(a[rows, p1][rows, p0])
                continue
            mass[f"{k}_x0"] = jnp.mean(a[rows, p0])
            mass[f"{k}_x1"] = jnp.mean(a[rows, p1])
        return jnp.mean((pred - yte) ** 2), jnp.var(yte), mass

    mse, var_y, mass = evaluate(params, data["xte"], data["yte"], data["p0"], data["p1"])
    runs = []
    for s in range(curves.shape[0]):
        m = {k: float(v[s]) for k, v in mass.items()}
        if name == "multihop":  # the query's row of (P + P^2) / 2
            m["x0"] = 0.5 * (m["hop1_x0"] + m["hop2_x0"])
            m["x1"] = 0.5 * (m["hop1_x1"] + m["hop2_x1"])
        else:
            top = "phi" if name == "one_layer" else "layer2"
            m["x0"], m["x1"] = m[f"{top}_x0"], m[f"{top}_x1"]
        runs.append({
            "train_curve": [float(v) for v in curves[s]],
            "test_mse": float(mse[s]),
            "test_rel_mse": float(mse[s] / var_y[s]),
            "var_y": float(var_y[s]),
            "attention_mass": m,
        })
    return runs


def summarise(runs: list[dict]) -> dict:
    """Mean, sd and median test errors and attention masses over seeds."""
    mse = np.array([r["test_mse"] for r in runs])
    rel = np.array([r["test_rel_mse"] for r in runs])
    m0 = np.array([r["attention_mass"]["x0"] for r in runs])
    m1 = np.array([r["attention_mass"]["x1"] for r in runs])
    return {
        "test_mse_mean": float(mse.mean()), "test_mse_std": float(mse.std(ddof=1) if len(mse) > 1 else 0.0),
        "test_mse_median": float(np.median(mse)),
        "test_rel_mse_mean": float(rel.mean()),
        "test_rel_mse_std": float(rel.std(ddof=1) if len(rel) > 1 else 0.0),
        "mass_x0_mean": float(m0.mean()), "mass_x1_mean": float(m1.mean()),
        "balance_mean": float(np.mean(np.minimum(m0, m1) / np.maximum(np.maximum(m0, m1), 1e-12))),
    }


def check_multihop_equals_formula() -> float:
    """The multi-hop model's output equals (P + P²) V X written by hand (float32)."""
    key = jax.random.PRNGKey(123)
    x = jax.random.normal(key, (N_TOKENS, DIM))
    p = init_params(jax.random.PRNGKey(7), "multihop", DIM)
    s = (x @ p["wq"].T) @ (x @ p["wk"].T).T / DIM**0.5
    s = jnp.where(jnp.asarray(parent_mask(N_TOKENS)), s, -jnp.inf)
    P = jax.nn.softmax(s, -1)
    ref = (P + P @ P) @ (x @ p["wv"].T)
    out = jax.jit(lambda *a: si.expectation(multihop_model, "out", *a))(x, p["wq"], p["wk"], p["wv"])
    return float(jnp.max(jnp.abs(out - ref)))


def plot(results: dict, cfg: argparse.Namespace, out: Path) -> None:
    """Training curves and attention masses, as ``out/multihop.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in MODELS:
        curves = np.array([r["train_curve"] for r in results["runs"][name]])
        ep = np.arange(1, curves.shape[1] + 1)
        med = np.median(curves, 0)
        axes[0].plot(ep, med, label=name)
        axes[0].fill_between(ep, np.percentile(curves, 25, 0), np.percentile(curves, 75, 0), alpha=0.2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("epoch (10 batches of 200)")
    axes[0].set_ylabel("train MSE (median, IQR over seeds)")
    axes[0].legend()
    width = 0.35
    xs = np.arange(len(MODELS))
    m0 = [results["summary"][n]["mass_x0_mean"] for n in MODELS]
    m1 = [results["summary"][n]["mass_x1_mean"] for n in MODELS]
    axes[1].bar(xs - width / 2, m0, width, label="mass on x_0")
    axes[1].bar(xs + width / 2, m1, width, label="mass on x_1")
    axes[1].set_xticks(xs, MODELS)
    axes[1].set_ylabel("query attention (mean over test set, seeds)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "multihop.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the reproduction from the command line (``argv``); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 seeds, few epochs")
    ap.add_argument("--no-progress", action="store_true",
                    help="hide progress bars (this one shows none)")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=200)
    ap.add_argument("--test-size", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--wr-norm", type=float, default=4.0)
    ap.add_argument("--self-edges", action="store_true",
                    help="allow phi_i = i (ablation; the second hop then tends to return to x_1)")
    ap.add_argument("--out", type=Path, default=Path("results/multihop"))
    cfg = ap.parse_args(argv)
    if cfg.quick:
        cfg.seeds, cfg.epochs, cfg.test_size = 2, 4, 200
    global SELF_EDGES
    SELF_EDGES = cfg.self_edges

    err = check_multihop_equals_formula()
    print(f"multi-hop model vs (P + P^2) V X by hand: max |diff| = {err:.2e}")
    assert err < 1e-4, err

    t0 = time.time()
    results = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
               "formula_check_max_abs_diff": err, "runs": {}, "summary": {}}
    data = jax.jit(jax.vmap(lambda s: seed_data(s, cfg)))(cfg.seed + jnp.arange(cfg.seeds))
    for name in MODELS:
        runs = train_all_seeds(name, data, cfg)
        results["runs"][name] = runs
        results["summary"][name] = summarise(runs)
        print(f"  {name:10s} done ({time.time() - t0:.0f} s)")
    results["seconds"] = time.time() - t0

    print(f"\n{'model':10s} {'test MSE':>18s} {'rel. MSE':>16s} {'mass x0':>8s} {'mass x1':>8s}")
    for name in MODELS:
        s = results["summary"][name]
        print(f"{name:10s} {s['test_mse_mean']:9.3f} ± {s['test_mse_std']:6.3f} "
              f"{s['test_rel_mse_mean']:7.3f} ± {s['test_rel_mse_std']:5.3f} "
              f"{s['mass_x0_mean']:8.3f} {s['mass_x1_mean']:8.3f}")

    # every model must learn: the training loss falls
    for name in MODELS:
        for r in results["runs"][name]:
            assert r["train_curve"][-1] < r["train_curve"][0], (name, r["train_curve"][:3])
    if not cfg.quick:
        cfg.out.mkdir(parents=True, exist_ok=True)
        (cfg.out / "results.json").write_text(json.dumps(results, indent=1))
        plot(results, cfg, cfg.out)
        print(f"wrote {cfg.out}/results.json and multihop.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
