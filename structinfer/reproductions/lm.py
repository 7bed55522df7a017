"""Character-level language modelling with the attention prior swapped.

The same small transformer is trained with five structural priors on its attention,
each a mechanism of ``structinfer.nn`` and nothing else changed (there is no
positional embedding: position enters only through the prior):

* ``uniform-causal`` — ``si.nn.causal()``: every earlier character equally likely a priori;
* ``window`` — ``si.nn.window(W)``: uniform over the last ``W`` characters (static);
* ``relative`` — ``si.nn.relative_position(D)``: a learned log-weight per head and distance
  (``D = context - 1``: every distance has its own);
* ``geometric`` — ``si.nn.geometric(q)``: ``p(d) ∝ q (1-q)^d`` with ``q`` learned per head;
* ``geometric-beta`` — ``si.nn.geometric_beta(α, β)``: each query's rate ``q_i ~ Beta(α, β)``
  is *inferred*, integrated out exactly (collapsed: the beta-geometric prior
  ``p(d) = B(α+1, β+d)/B(α, β)``, so the edge posterior is the exact posterior of the
  model with ``q_i`` unknown, the fixed point the mean-field loop of
  ``structinfer.infer.geometric_beta`` approaches); ``(α, β)`` per head are learned
  (type-II maximum likelihood).

Corpus (no download): the ``*.py`` files at the top level of the running interpreter's
standard library (``sysconfig.get_paths()["stdlib"]``), split by file — ``crc32(name) % 10``:
0 → test, 1 → validation, else train — read as bytes (fixed vocabulary of 256). The
corpus therefore depends on the Python version; it is recorded in the results.

Network: byte embedding (tied with the output layer), ``--layers`` pre-LayerNorm blocks
(``si.nn.Attention`` with ``--heads`` heads, GELU MLP ×4), Adam with linear warm-up and
cosine decay, gradient clipping at 1. Held-out bits per character: the mean next-byte
cross-entropy / ln 2 over ``--eval-windows`` fixed, evenly spaced windows of ``--context``
bytes of the validation and test splits (every position of a window counts). Error bars:
mean ± standard deviation over ``--seeds`` seeds (seed ``s`` sets the initialisation and
the training batches). Wall time per step: the median after the first two steps (which
compile). Learned hyperparameters: each head's *prior* over the distance back from the
last position of a window (the posterior of the mechanism with zero scores, read with
``si.marginals``) — its 95 % window (the smallest ``w`` with ``P(d < w) ≥ 0.95``) and mean
distance, plus the raw ``q`` / ``(α, β)``.

    structinfer reproduce lm --quick                 # seconds, writes nothing
    structinfer reproduce lm --quick --out /tmp/lm   # the same, with the outputs (a test)
    structinfer reproduce lm --out results/lm        # the full run (see --help)
    structinfer reproduce lm --out results/lm -- --resume   # goes on after an interruption

Writes ``results.json``, ``results.md`` (the table) and ``lm.png`` to ``--out`` (default
``results/lm``, ``structinfer-reproduce/lm`` through ``structinfer reproduce``; a
``--quick`` run writes only when ``--out`` is given). Its own options (``--resume``,
``--priors``, ``--seeds``, ...) go after ``--`` in ``structinfer reproduce lm``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from structinfer import nn as sinn

PRIORS = ("uniform-causal", "window", "relative", "geometric", "geometric-beta")
VOCAB = 256


# --------------------------------------------------------------------------- corpus
def stdlib_corpus() -> tuple[dict[str, np.ndarray], dict]:
    """The top-level ``*.py`` files of this interpreter's standard library, split by file.

    Returns ``{"train" | "val" | "test": uint8 array}`` (files joined by a NUL byte, in
    sorted order) and a description (directory, Python version, files and bytes per split).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise RuntimeError(f"no *.py files in the standard library directory {root}")
    parts: dict[str, list[bytes]] = {"train": [], "val": [], "test": []}
    for f in files:
        bucket = zlib.crc32(f.name.encode()) % 10
        split = "test" if bucket == 0 else "val" if bucket == 1 else "train"
        parts[split].append(f.read_bytes())
    data = {k: np.frombuffer(b"\0".join(v), dtype=np.uint8) for k, v in parts.items()}
    info = {"stdlib": str(root), "python": platform.python_version(),
            "files": {k: len(v) for k, v in parts.items()},
            "bytes": {k: int(v.size) for k, v in data.items()}}
    return data, info


def eval_windows(data: np.ndarray, context: int, count: int) -> np.ndarray:
    """``count`` evenly spaced windows of ``context + 1`` bytes (inputs and next bytes)."""
    starts = np.linspace(0, data.size - context - 2, count).astype(np.int64)
    return np.stack([data[s : s + context + 1] for s in starts])


def train_batches(data: np.ndarray, context: int, batch: int, seed: int) -> Iterator[np.ndarray]:
    """Endless random batches of ``context + 1``-byte windows, ``(batch, context + 1)``."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, data.size - context - 1, batch)
        yield np.stack([data[s : s + context + 1] for s in starts])


# --------------------------------------------------------------------------- model
def mechanism(prior: str, cfg: argparse.Namespace) -> Callable:
    """The attention mechanism of each prior; each head starts at its own recency scale."""
    H = cfg.heads
    if prior == "uniform-causal":
        return sinn.causal()
    if prior == "window":
        return sinn.window(cfg.window)
    if prior == "relative":
        return sinn.relative_position(cfg.context - 1)
    # initial mean distances spread over the heads, 1 .. context / 4
    mean_d = np.geomspace(1.0, max(cfg.context / 4, 2.0), H)[:, None]
    if prior == "geometric":
        return sinn.geometric(1.0 / (1.0 + mean_d))  # E[d] = (1 - q) / q
    if prior == "geometric-beta":
        # E[d] = beta / (alpha - 1) for alpha > 1: alpha = 2 gives beta = mean_d
        return sinn.geometric_beta(np.full((H, 1), 2.0), mean_d)
    raise ValueError(f"unknown prior {prior!r}; expected one of {PRIORS}")


class Block(nnx.Module):
    """Pre-norm transformer block: structinfer attention, then a GELU MLP."""

    def __init__(self, mech: Callable, cfg: argparse.Namespace, rngs: nnx.Rngs):
        d = cfg.d_model
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = sinn.Attention(mech, num_heads=cfg.heads, in_features=d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class CharLM(nnx.Module):
    """Byte-level transformer; position information comes only from the attention prior."""

    def __init__(self, mech: Callable, cfg: argparse.Namespace, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(mech, cfg, rngs) for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln(x))  # (..., n, 256) logits


def loss_fn(model: CharLM, window: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) over ``(batch, context + 1)`` windows."""
    logits = model(window[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:]).mean()


@nnx.jit
def train_step(model: CharLM, opt: nnx.Optimizer, window: jax.Array) -> jax.Array:
    """One optimiser step on a batch of windows; returns the loss before it."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, window)
    opt.update(model, grads)
    return loss


@nnx.jit
def eval_loss(model: CharLM, windows: jax.Array) -> jax.Array:
    """The mean next-byte loss of ``windows`` (jitted)."""
    return loss_fn(model, windows)


def bits_per_char(model: CharLM, windows: np.ndarray, batch: int) -> float:
    """Mean next-byte loss over ``windows`` in bits per character."""
    losses = [float(eval_loss(model, jnp.asarray(windows[i : i + batch], jnp.int32)))
              * len(windows[i : i + batch]) for i in range(0, len(windows), batch)]
    return sum(losses) / len(windows) / math.log(2)


# --------------------------------------------------------------------------- hyperparameters
def head_priors(layer: sinn.Attention, context: int) -> np.ndarray:
    """Each head's prior over the distance ``d = 0 .. context-1`` back from the last query,
    ``(heads, context)`` (``Attention.prior_tables``: the edge's log-prior table)."""
    row = jnp.exp(layer.prior_tables(context)["phi"][:, -1, :])  # (heads, parents j)
    return np.asarray(row[:, ::-1])  # index d = context - 1 - j


def summarise_heads(model: CharLM, prior: str, context: int) -> list[list[dict]]:
    """Each head's 95 % window, mean distance and hyperparameters, per layer."""
    out = []
    for block in model.blocks:
        pmf = head_priors(block.attn, context)
        cdf = np.cumsum(pmf, -1)
        hyper = {k: np.asarray(v).reshape(v.shape[0], -1)
                 for k, v in block.attn.hyperparameters().items() if k != "bias"}
        heads = []
        for h in range(pmf.shape[0]):
            rec = {"window95": int(np.argmax(cdf[h] >= 0.95) + 1),
                   "mean_distance": float((pmf[h] * np.arange(context)).sum())}
            rec.update({k: float(v[h, 0]) for k, v in hyper.items()})
            if prior == "geometric-beta":
                rec["prior_mean_q"] = rec["alpha"] / (rec["alpha"] + rec["beta"])
            heads.append(rec)
        out.append(heads)
    return out


# --------------------------------------------------------------------------- one run
def run(
    prior: str, seed: int, data: dict[str, np.ndarray], cfg: argparse.Namespace, quiet: bool
) -> dict:
    """Train one model (one prior, one seed) and evaluate it on the validation and test splits."""
    model = CharLM(mechanism(prior, cfg), cfg, nnx.Rngs(seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.steps // 10, 1), max(cfg.steps, 2), cfg.lr / 10)
    opt = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule)),
                        wrt=nnx.Param)
    batches = train_batches(data["train"], cfg.context, cfg.batch, seed)
    times, losses = [], []
    bar = tqdm(range(cfg.steps), desc=f"{prior:>14s} seed {seed}", leave=False,
               disable=quiet, file=sys.stderr)
    for step in bar:
        window = jnp.asarray(next(batches), jnp.int32)
        t0 = time.perf_counter()
        loss = float(train_step(model, opt, window))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if step % 10 == 0:
            bar.set_postfix(bpc=f"{loss / math.log(2):.3f}")
    res = {"prior": prior, "seed": seed,
           "train_bpc_last": float(np.mean(losses[-max(len(losses) // 10, 1):]) / math.log(2)),
           "step_seconds": statistics.median(times[2:] or times)}
    for split in ("val", "test"):
        w = eval_windows(data[split], cfg.context, cfg.eval_windows)
        res[f"{split}_bpc"] = bits_per_char(model, w, cfg.batch)
    res["heads"] = summarise_heads(model, prior, cfg.context)
    res["explain"] = str(model.blocks[0].attn.explain(jnp.zeros((1, cfg.context, cfg.d_model))))
    return res


# --------------------------------------------------------------------------- report
def aggregate(runs: list[dict], priors: Sequence[str]) -> dict:
    """Mean and sd over seeds of each prior's metrics."""
    table = {}
    for p in priors:
        rs = [r for r in runs if r["prior"] == p]
        row = {}
        for key in ("val_bpc", "test_bpc", "train_bpc_last", "step_seconds"):
            xs = [r[key] for r in rs]
            row[key] = {"mean": float(np.mean(xs)),
                        "sd": float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0}
        # each head's 95 % window, averaged over seeds (heads are not matched across
        # seeds, so sort each layer's windows first)
        wins = np.array([[sorted(h["window95"] for h in layer) for layer in r["heads"]]
                         for r in rs])
        row["window95_sorted_by_layer"] = wins.mean(0).round(1).tolist()
        table[p] = row
    return table


def markdown(table: dict, cfg: argparse.Namespace, info: dict, seconds: float) -> str:
    """The results table as Markdown."""
    n = cfg.seeds
    lines = [
        f"Held-out bits per character, mean ± sd over {n} seed{'s' if n > 1 else ''} "
        f"(context {cfg.context}, {cfg.layers} layers × {cfg.heads} heads, d_model "
        f"{cfg.d_model}, {cfg.steps} steps of batch {cfg.batch}; Python {info['python']} "
        f"stdlib: {info['bytes']['train']:,} / {info['bytes']['val']:,} / "
        f"{info['bytes']['test']:,} train / val / test bytes). Wall time per training "
        f"step: median. 95 % window: each head's prior, per layer, heads sorted.",
        "",
        "| prior | test bpc | val bpc | train bpc (last 10 %) | s / step | 95 % window per head |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p, row in table.items():
        f = lambda k, d=3: f"{row[k]['mean']:.{d}f} ± {row[k]['sd']:.{d}f}"  # noqa: E731
        wins = "; ".join(", ".join(f"{w:g}" for w in layer)
                         for layer in row["window95_sorted_by_layer"])
        lines.append(f"| {p} | {f('test_bpc')} | {f('val_bpc')} | {f('train_bpc_last')} "
                     f"| {f('step_seconds', 4)} | {wins} |")
    lines += ["", f"Total wall time: {seconds / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def plot(table: dict, runs: list[dict], out: Path) -> None:
    """Bits per character and head windows per prior, as ``out/lm.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    priors = list(table)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    means = [table[p]["test_bpc"]["mean"] for p in priors]
    sds = [table[p]["test_bpc"]["sd"] for p in priors]
    a.bar(range(len(priors)), means, yerr=sds, capsize=4, color="#4c72b0")
    lo = min(m - s for m, s in zip(means, sds))
    a.set_ylim(max(0.0, lo - 0.1), max(m + s for m, s in zip(means, sds)) + 0.05)
    a.set_xticks(range(len(priors)), priors, rotation=20)
    a.set_ylabel("test bits per character")
    a.set_title("held-out bpc (mean ± sd over seeds)")
    for i, p in enumerate(priors):
        ws = [h["window95"] for r in runs if r["prior"] == p for layer in r["heads"] for h in layer]
        b.scatter(np.full(len(ws), i) + np.random.default_rng(i).uniform(-0.2, 0.2, len(ws)), ws,
                  s=14, alpha=0.7)
    b.set_yscale("log")
    b.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    b.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    b.set_xticks(range(len(priors)), priors, rotation=20)
    b.set_ylabel("95 % window of the prior (characters)")
    b.set_title("learned recency of every head")
    fig.tight_layout()
    fig.savefig(out / "lm.png", dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the reproduction from the command line (``argv``); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny network, few steps; writes nothing unless --out is given")
    ap.add_argument("--out", type=Path, default=None,
                    help="where results.json, results.md and lm.png go (default results/lm)")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, default=3, help="number of seeds per prior")
    ap.add_argument("--priors", nargs="+", default=list(PRIORS), choices=PRIORS)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--window", type=int, default=16, help="the window prior's size")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-windows", type=int, default=512)
    ap.add_argument("--no-progress", "--quiet", dest="quiet", action="store_true",
                    help="hide the progress bars")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in OUT/results.json (written after every "
                         "run) and train only the missing (prior, seed) pairs; the file "
                         "must come from the same settings")
    cfg = ap.parse_args(argv)
    write = cfg.out is not None or not cfg.quick
    cfg.out = cfg.out or Path("results/lm")
    if cfg.quick:
        cfg.seeds, cfg.steps, cfg.batch, cfg.context, cfg.window = 1, 4, 4, 16, 4
        cfg.layers, cfg.heads, cfg.d_model, cfg.eval_windows = 1, 2, 16, 8

    data, info = stdlib_corpus()
    print(f"corpus: {info['stdlib']} (Python {info['python']}): files {info['files']}, "
          f"bytes {info['bytes']}", flush=True)
    done, before = _previous_runs(cfg) if cfg.resume else ({}, 0.0)
    pending = dict(done)  # kept in results.json until this run reaches them
    t0 = time.time()
    runs = []
    for prior in cfg.priors:
        for seed in range(cfg.seed, cfg.seed + cfg.seeds):
            r = pending.pop((prior, seed), None)
            if r is None:
                r = run(prior, seed, data, cfg, cfg.quiet)
                seconds = before + time.time() - t0
                if write:  # an interrupted experiment resumes from here (--resume)
                    cfg.out.mkdir(parents=True, exist_ok=True)
                    _write_json(cfg, info, [*runs, r, *pending.values()], None, seconds)
            runs.append(r)
            print(f"  {prior:>14s} seed {seed}: test {r['test_bpc']:.3f} bpc, val "
                  f"{r['val_bpc']:.3f}, {r['step_seconds'] * 1e3:.0f} ms/step "
                  f"({'from results.json' if (prior, seed) in done else f'{time.time() - t0:.0f} s'})",
                  flush=True)
    seconds = before + time.time() - t0
    table = aggregate(runs, cfg.priors)
    md = markdown(table, cfg, info, seconds)
    print("\n" + md)
    for r in runs:  # never a finite wrong number: every held-out loss is a number
        assert np.isfinite(r["val_bpc"]) and np.isfinite(r["test_bpc"]), r
    if not write:
        return 0
    cfg.out.mkdir(parents=True, exist_ok=True)
    _write_json(cfg, info, runs, table, seconds)
    (cfg.out / "results.md").write_text(md)
    plot(table, runs, cfg.out)
    print(f"wrote {cfg.out}/results.json, results.md, lm.png")
    return 0


#: the settings a resumed run must share with the runs it keeps
SETTINGS = ("steps", "batch", "context", "window", "layers", "heads", "d_model", "lr",
            "eval_windows", "quick")


def _write_json(cfg: argparse.Namespace, info: dict, runs: list[dict], table: dict | None,
                seconds: float) -> None:
    res = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
           "corpus": info, "runs": runs, "table": table, "seconds": seconds,
           "load_average": list(np.round(np.array(_loadavg()), 2))}
    (cfg.out / "results.json").write_text(json.dumps(res, indent=1))


def _previous_runs(cfg: argparse.Namespace) -> tuple[dict, float]:
    """The runs of ``OUT/results.json`` by ``(prior, seed)`` and the seconds they took."""
    path = cfg.out / "results.json"
    if not path.exists():
        return {}, 0.0
    old = json.loads(path.read_text())
    differ = {k: (old["config"].get(k), getattr(cfg, k)) for k in SETTINGS
              if old["config"].get(k) != getattr(cfg, k)}
    if differ:
        raise SystemExit(f"--resume: {path} was made with other settings "
                         f"(setting: file's, this run's): {differ}")
    return {(r["prior"], r["seed"]): r for r in old["runs"]}, float(old["seconds"])


def _loadavg() -> tuple[float, float, float]:
    try:
        import os

        return os.getloadavg()
    except (AttributeError, OSError):  # pragma: no cover - not on every platform
        return (float("nan"),) * 3


if __name__ == "__main__":
    sys.exit(main())
