"""Inverse distance weighting attention (McCarter): two moons, special cases, digits.

Every attention classifier is a structinfer model: the *query* is the input, the
*parents* are ``P`` learned prototypes (keys), the prior over them is uniform, the
score is one of McCarter's similarities, and the value of a prototype is its learned
class-logit vector, so the logits are ``E[v_φ] = softmax(score(q, K)) V`` (eq. 5 for IDW).

Methods (McCarter sec. 2.1, 3):

* ``fc_relu``: one hidden ReLU layer with ``P`` units (no structinfer model; the baseline);
* ``dot``: scaled dot product ``qᵀk/√d`` (``si.scores.Dot``);
* ``neg_sq``: ``-‖q-k‖²`` (eq. 1), ``gaussian``: ``exp(-‖q-k‖²/σ²)``, σ = 1 (eq. 2),
  ``inverse``: ``1/(ε+‖q-k‖^p)`` (eq. 3), ``idw``: ``-log(ε+‖q-k‖^p)`` (eq. 4), p = 2,
  ε = 1e-3 — via ``structinfer.mechanisms.idw_attention``.

Settings (McCarter appendix A.1): two moons with 100 training and 20 test points
(``sklearn.datasets.make_moons``, noise ``--noise``; the paper does not state it),
batch 10, 25 epochs, learning rate 0.01; digits: batch 4, 50 epochs, learning rate
0.001, 20 prototypes. Optimiser: AMSGrad (``optax.amsgrad``) with cosine annealing of
the learning rate to 0 over the run. Keys (and the FC-ReLU first-layer weights) are
initialised ``N(mean, (0.1·sd)²)`` per input feature, values (and FC-ReLU output
weights and biases) at zero. Cross-entropy loss.

The paper's MNIST table is reproduced on scikit-learn's 8×8 handwritten digits (the
available stand-in: 1797 images, 64 pixels scaled to [0, 1], a stratified 75/25 split).

Special cases (sec. 2.2, eq. 7): for each trained IDW network and desired class c ∈
{0, 1} at a special input, add the prototype ``k' = q``, ``v' = η e_c`` with η from
eq. 7 (times 1.001, since eq. 7's η makes class c tie), and report accuracy before →
after. The prediction at the special input is checked to become c (and not to with
0.999 η).

    structinfer reproduce idw            # full (two moons × 3 sizes, digits), ~minutes
    structinfer reproduce idw --quick    # CI smoke run
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
from jax.typing import ArrayLike

import structinfer as si
from structinfer.mechanisms import augment_special_case, idw_attention, special_case_eta

METHODS = ("fc_relu", "dot", "neg_sq", "gaussian", "inverse", "idw")
LABELS = {
    "fc_relu": "FC ReLU", "dot": "Scaled dot softmax", "neg_sq": "Neg dist softmax",
    "gaussian": "Gaussian dist softmax", "inverse": "Inv dist softmax", "idw": "IDW",
}
P_EXP, EPS, SIGMA = 2.0, 1e-3, 1.0
#: McCarter Table 1 (MNIST, 20 prototypes), test accuracy in percent, as printed
PAPER_MNIST = {"fc_relu": 95.99, "dot": 93.15, "neg_sq": 83.63, "gaussian": 11.35,
               "inverse": 11.35, "idw": 88.20}


# --------------------------------------------------------------------------- models
def dot_attention(q: jax.Array, keys: jax.Array, values: jax.Array) -> None:
    """Scaled dot-product attention over prototypes: ``φ ~ Uniform(P)``, ``ψ = qᵀk/√d``."""
    with numpyro.plate("queries", q.shape[-2]):
        j = si.edge("phi", si.priors.Uniform(keys.shape[-2]),
                    si.scores.Dot(q, keys, scale=q.shape[-1] ** -0.5))
        numpyro.deterministic("out", values[j])


def logits_fn(method: str, params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Class logits ``(n, C)`` for inputs ``x`` ``(n, d)``."""
    if method == "fc_relu":
        return jax.nn.relu(x @ params["keys"].T + params["bias"]) @ params["values"]
    if method == "dot":
        return si.expectation(dot_attention, "out", x, params["keys"], params["values"])
    return si.expectation(idw_attention, "out", x, params["keys"], params["values"],
                          score=method, p=P_EXP, eps=EPS, sigma=SIGMA)


def idw_formula(x: ArrayLike, keys: ArrayLike, values: ArrayLike) -> np.ndarray:
    """McCarter eq. 5 written directly (independent of structinfer)."""
    d2 = np.sum((np.asarray(x, np.float64)[:, None] - np.asarray(keys, np.float64)[None]) ** 2, -1)
    w = 1.0 / (EPS + d2 ** (P_EXP / 2))
    return (w / w.sum(-1, keepdims=True)) @ np.asarray(values, np.float64)


def init_params(
    key: jax.Array, method: str, xtr: jax.Array, num_protos: int, num_classes: int
) -> dict[str, jax.Array]:
    """Prototype keys near the data mean, zero values (and zero biases for ``fc_relu``)."""
    mean, sd = xtr.mean(0), xtr.std(0)
    keys = mean + 0.1 * sd * jax.random.normal(key, (num_protos, xtr.shape[1]))
    p = {"keys": keys, "values": jnp.zeros((num_protos, num_classes))}
    if method == "fc_relu":
        p["bias"] = jnp.zeros((num_protos,))
    return p


def train(
    method: str,
    xtr: ArrayLike,
    ytr: ArrayLike,
    num_protos: int,
    num_classes: int,
    *,
    epochs: int,
    batch: int,
    lr: float,
    seed: int,
) -> tuple[dict[str, jax.Array], np.ndarray]:
    """AMSGrad + cosine annealing, shuffled mini-batches; the whole run is one ``scan``."""
    key = jax.random.PRNGKey(seed)
    k_init, k_perm = jax.random.split(key)
    xtr, ytr = jnp.asarray(xtr, jnp.float32), jnp.asarray(ytr)
    params = init_params(k_init, method, xtr, num_protos, num_classes)
    n = xtr.shape[0]
    per_epoch = n // batch
    total = per_epoch * epochs
    opt = optax.amsgrad(optax.cosine_decay_schedule(lr, total))
    perms = jax.vmap(lambda k: jax.random.permutation(k, n)[: per_epoch * batch])(
        jax.random.split(k_perm, epochs)).reshape(total, batch)

    def loss_fn(p, idx):
        logits = logits_fn(method, p, xtr[idx])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, ytr[idx]))

    def step(carry, idx):
        p, s = carry
        loss, g = jax.value_and_grad(loss_fn)(p, idx)
        upd, s = opt.update(g, s, p)
        return (optax.apply_updates(p, upd), s), loss

    run = jax.jit(lambda p: jax.lax.scan(step, (p, opt.init(p)), perms))
    (params, _), losses = run(params)
    return params, np.asarray(losses).reshape(epochs, per_epoch).mean(1)


predict_logits = jax.jit(logits_fn, static_argnums=0)


def accuracy(method: str, params: dict[str, jax.Array], x: ArrayLike, y: ArrayLike) -> float:
    """The fraction of ``x`` whose predicted class is ``y``."""
    pred = jnp.argmax(predict_logits(method, params, jnp.asarray(x, jnp.float32)), -1)
    return float(jnp.mean(pred == jnp.asarray(y)))


# --------------------------------------------------------------------------- experiments
def moons_data(seed: int, noise: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Two moons: 100 training and 20 test points, ``(xtr, ytr, xte, yte)``."""
    from sklearn.datasets import make_moons

    x, y = make_moons(n_samples=120, noise=noise, random_state=seed)
    return x[:100].astype(np.float32), y[:100], x[100:].astype(np.float32), y[100:]


def special_case(
    params: dict[str, jax.Array],
    q: tuple[float, ...],
    c: int,
    xtr: ArrayLike,
    ytr: ArrayLike,
    xte: ArrayLike,
    yte: ArrayLike,
) -> dict:
    """Eq. 7 augmentation of a trained IDW network so that it predicts ``c`` at ``q``."""
    keys, values = params["keys"], params["values"]
    qj = jnp.asarray(q, jnp.float32)

    def predict_at(k, v, x):
        return int(jnp.argmax(predict_logits("idw", {"keys": k, "values": v}, jnp.asarray(x)[None])[0]))

    before = {"train": accuracy("idw", params, xtr, ytr), "test": accuracy("idw", params, xte, yte),
              "pred_at_q": predict_at(keys, values, qj)}
    eta = float(special_case_eta(qj, keys, values, c, p=P_EXP, eps=EPS))
    rec = {"q": [float(v) for v in q], "c": int(c), "eta": eta, "before": before}
    if eta <= 0:  # already predicted: nothing to add
        rec.update(after=before, added=False, flips=True, tie_respected=True)
        return rec
    k2, v2 = augment_special_case(keys, values, qj, c, 1.001 * eta)
    k3, v3 = augment_special_case(keys, values, qj, c, 0.999 * eta)
    aug = {"keys": k2, "values": v2}
    rec.update(
        added=True,
        after={"train": accuracy("idw", aug, xtr, ytr), "test": accuracy("idw", aug, xte, yte),
               "pred_at_q": predict_at(k2, v2, qj)},
        flips=predict_at(k2, v2, qj) == c,
        tie_respected=predict_at(k3, v3, qj) != c,
    )
    return rec


def run_moons(cfg: argparse.Namespace) -> dict:
    """Every method and prototype count on two moons, with the special-case augmentation."""
    xtr, ytr, xte, yte = moons_data(cfg.seed, cfg.noise)
    res = {"accuracy": {}, "keys": {}, "special_cases": [], "data": {
        "xtr": xtr.tolist(), "ytr": ytr.tolist(), "xte": xte.tolist(), "yte": yte.tolist()}}
    for method in cfg.methods:
        for P in cfg.protos:
            params, losses = train(method, xtr, ytr, P, 2, epochs=cfg.moons_epochs, batch=10,
                                   lr=0.01, seed=cfg.seed)
            tag = f"{method}/{P}"
            res["accuracy"][tag] = {"train": accuracy(method, params, xtr, ytr),
                                    "test": accuracy(method, params, xte, yte),
                                    "loss_first_epoch": float(losses[0]),
                                    "loss_last_epoch": float(losses[-1])}
            res["keys"][tag] = np.asarray(params["keys"]).tolist()
            if method == "idw":
                if P == cfg.protos[0]:
                    res["idw_formula_max_abs_diff"] = float(np.max(np.abs(
                        np.asarray(predict_logits("idw", params, jnp.asarray(xte)), np.float64)
                        - idw_formula(xte, params["keys"], params["values"]))))
                for q in cfg.special_inputs:
                    for c in (0, 1):
                        rec = special_case(params, q, c, xtr, ytr, xte, yte)
                        rec["num_protos"] = P
                        res["special_cases"].append(rec)
    return res


def run_digits(cfg: argparse.Namespace) -> dict:
    """Every method with 20 prototypes on scikit-learn's digits."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, data.target, test_size=0.25,
                                          stratify=data.target, random_state=cfg.seed)
    out = {"accuracy": {}, "keys": {}}
    for method in cfg.methods:
        params, losses = train(method, xtr, ytr, 20, 10, epochs=cfg.digits_epochs, batch=4,
                               lr=1e-3, seed=cfg.seed)
        out["accuracy"][method] = {"train": accuracy(method, params, xtr, ytr),
                                   "test": accuracy(method, params, xte, yte),
                                   "loss_first_epoch": float(losses[0]),
                                   "loss_last_epoch": float(losses[-1])}
        order = np.argsort(np.argmax(np.asarray(params["values"]), -1), kind="stable")
        out["keys"][method] = np.asarray(params["keys"])[order].tolist()
    acc = {m: out["accuracy"][m]["test"] for m in cfg.methods}
    if {"idw", "dot", "neg_sq", "gaussian", "inverse"} <= set(acc):
        out["idw_beats_other_distances"] = bool(
            all(acc["idw"] > acc[m] for m in ("neg_sq", "gaussian", "inverse")))
        out["idw_trails_dot"] = bool(acc["idw"] < acc["dot"])
    if {"idw", "fc_relu"} <= set(acc):
        out["idw_trails_fc_relu"] = bool(acc["idw"] < acc["fc_relu"])
    return out


# --------------------------------------------------------------------------- figures
def plot_moons(res: dict, cfg: argparse.Namespace, out: Path) -> None:
    """The learned keys on two moons, one panel per method and prototype count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = res["data"]
    xtr, ytr, xte, yte = (np.asarray(d[k]) for k in ("xtr", "ytr", "xte", "yte"))
    fig, axes = plt.subplots(len(cfg.protos), len(cfg.methods),
                             figsize=(2.6 * len(cfg.methods), 2.4 * len(cfg.protos)), squeeze=False)
    for i, P in enumerate(cfg.protos):
        for j, m in enumerate(cfg.methods):
            ax = axes[i, j]
            ax.scatter(xtr[:, 0], xtr[:, 1], c=ytr, cmap="coolwarm", s=6, alpha=0.5)
            ax.scatter(xte[:, 0], xte[:, 1], c=yte, cmap="coolwarm", s=14, marker="s", edgecolors="k",
                       linewidths=0.3)
            k = np.asarray(res["keys"][f"{m}/{P}"])
            ax.scatter(k[:, 0], k[:, 1], c="k", marker="x", s=18)
            a = res["accuracy"][f"{m}/{P}"]
            ax.set_title(f"{LABELS[m]} P={P}\n{100 * a['train']:.0f}% ({100 * a['test']:.0f}%)", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(out / "moons_keys.png", dpi=120)
    plt.close(fig)


def plot_digit_keys(res: dict, cfg: argparse.Namespace, out: Path) -> None:
    """The learned digit prototypes, one row per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cfg.methods), 20, figsize=(12, 0.75 * len(cfg.methods) + 0.3),
                             squeeze=False)
    for i, m in enumerate(cfg.methods):
        keys = np.asarray(res["keys"][m])
        for j in range(20):
            axes[i, j].imshow(keys[j].reshape(8, 8), cmap="gray_r")
            axes[i, j].axis("off")
        axes[i, 0].set_title(LABELS[m], fontsize=7, loc="left")
    fig.tight_layout()
    fig.savefig(out / "digits_keys.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the reproduction from the command line (``argv``); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run")
    ap.add_argument("--no-progress", action="store_true",
                    help="hide progress bars (this one shows none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.1, help="two-moons noise")
    ap.add_argument("--moons-epochs", type=int, default=25)
    ap.add_argument("--digits-epochs", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("results/idw"))
    cfg = ap.parse_args(argv)
    cfg.methods = list(METHODS)
    cfg.protos = [2, 16, 128]
    cfg.special_inputs = [(0.5, 0.25), (-0.5, 0.75)]
    if cfg.quick:
        cfg.protos, cfg.methods, cfg.special_inputs = [16], ["dot", "idw"], [(0.5, 0.25)]
        cfg.digits_epochs = 2

    t0 = time.time()
    moons = run_moons(cfg)
    print(f"two moons done ({time.time() - t0:.0f} s)", flush=True)
    digits = run_digits(cfg)
    print(f"digits done ({time.time() - t0:.0f} s)\n")

    print("Two moons: train (test) accuracy, %")
    print(f"{'method':22s}" + "".join(f"{'P=' + str(P):>14s}" for P in cfg.protos))
    for m in cfg.methods:
        cells = "".join(
            f"{100 * moons['accuracy'][f'{m}/{P}']['train']:7.0f} ({100 * moons['accuracy'][f'{m}/{P}']['test']:3.0f})"
            for P in cfg.protos)
        print(f"{LABELS[m]:22s}{cells}")
    print("\nIDW special cases (eq. 7): train/test accuracy before -> after")
    for r in moons["special_cases"]:
        b, a = r["before"], r["after"]
        print(f"  P={r['num_protos']:3d} q={tuple(r['q'])} c={r['c']} eta={r['eta']:8.3g}: "
              f"{100 * b['train']:3.0f}/{100 * b['test']:3.0f} -> {100 * a['train']:3.0f}/{100 * a['test']:3.0f}"
              f"  pred at q {b['pred_at_q']} -> {a['pred_at_q']}")
    print("\nDigits (8x8, 20 prototypes): test accuracy, ours vs McCarter's MNIST")
    for m in cfg.methods:
        print(f"  {LABELS[m]:22s} {100 * digits['accuracy'][m]['test']:6.2f}%   (paper {PAPER_MNIST[m]:.2f}%)")
    for k in ("idw_beats_other_distances", "idw_trails_dot", "idw_trails_fc_relu"):
        if k in digits:
            print(f"  {k}: {digits[k]}")

    # checks that hold in every mode
    assert moons["idw_formula_max_abs_diff"] < 1e-4, moons["idw_formula_max_abs_diff"]
    for r in moons["special_cases"]:
        assert r["flips"] and r["tie_respected"], r
    for tag, a in moons["accuracy"].items():
        assert a["loss_last_epoch"] < a["loss_first_epoch"], (tag, a)
    assert moons["accuracy"][f"idw/{cfg.protos[-1]}"]["test"] >= 0.75
    assert digits["accuracy"]["idw"]["test"] > 0.3  # chance is 0.1

    if not cfg.quick:
        cfg.out.mkdir(parents=True, exist_ok=True)
        moons_json = {k: v for k, v in moons.items() if k != "data"}
        res = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
               "moons": moons_json, "digits": digits, "paper_mnist_test_accuracy": PAPER_MNIST,
               "seconds": time.time() - t0}
        (cfg.out / "results.json").write_text(json.dumps(res))
        plot_moons(moons, cfg, cfg.out)
        plot_digit_keys(digits, cfg, cfg.out)
        print(f"wrote {cfg.out}/results.json, moons_keys.png, digits_keys.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
