r"""Distance-based attention and inverse distance weighting (McCarter, "Inverse distance
weighting attention"), with the low-impact special-case augmentation (sec. 2.2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro

from .. import priors, scores
from ..primitives import edge
from ._common import features

__all__ = ["idw_attention", "special_case_eta", "augment_special_case", "DISTANCE_SCORES"]

DISTANCE_SCORES = {
    "idw": "eq. 4: -log(eps + ||q - k||^p)",
    "neg_sq": "eq. 1: -||q - k||^2",
    "gaussian": "eq. 2: exp(-||q - k||^2 / sigma^2)",
    "inverse": "eq. 3: 1 / (eps + ||q - k||^p)",
}
"""The ``score`` names [`idw_attention`][structinfer.mechanisms.idw_attention] accepts, and
the McCarter equation each implements."""


def _score(q, keys, kind: str, p: float, eps: float, sigma: float) -> scores.Score:
    if kind == "idw":
        return scores.NegLogDist(q, keys, p=p, eps=eps)
    if kind == "neg_sq":
        return scores.NegSqDist(q, keys, precision=2.0)
    if kind == "gaussian":
        return scores.GaussianKernel(q, keys, sigma=sigma)
    if kind == "inverse":
        return scores.InvDist(q, keys, p=p, eps=eps)
    raise ValueError(
        f"idw_attention: unknown score {kind!r}; expected one of {sorted(DISTANCE_SCORES)}"
    )


def idw_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    score: str = "idw",
    p: float = 2.0,
    eps: float = 1e-3,
    sigma: float = 1.0,
) -> None:
    r"""Attention over prototypes with a distance score; ``"idw"`` is Shepard's weighting.

    ``score="idw"`` is Shepard's inverse distance weighting; the other scores are
    McCarter's alternatives.

    Graph:
        query nodes $q_{1..n}$ (children), prototype keys $k^{(1..P)}$ (parents)
        carrying values $v^{(i)}$ (e.g. class logits).

    Prior:
        uniform over prototypes.

    Potentials:
        ``"idw"``: $-\log(\epsilon + \|q - k\|^p)$ (eq. 4), so that the attention is
        $\frac{(\epsilon + d_i^p)^{-1}}{\sum_j (\epsilon + d_j^p)^{-1}}$ (eq. 5);
        ``"neg_sq"``: $-\|q-k\|^2$ (eq. 1); ``"gaussian"``:
        $\exp(-\|q-k\|^2/\sigma^2)$ (eq. 2); ``"inverse"``: $1/(\epsilon + \|q-k\|^p)$ (eq. 3).

    Value:
        $v^{(\phi)}$; the output is $\sigma(d) V$, the predicted class its argmax.

    Args:
        q: queries ``(n, d)``.
        keys: prototypes $k^{(i)}$, ``(P, d)``.
        values: prototype values $v^{(i)}$, ``(P, C)``.
        score: one of [`DISTANCE_SCORES`][structinfer.mechanisms.DISTANCE_SCORES].
        p: distance exponent $p > 0$ (``"idw"``, ``"inverse"``).
        eps: offset $\epsilon > 0$ (``"idw"``, ``"inverse"``).
        sigma: kernel width $\sigma$ (``"gaussian"``).

    Sites:
        ``phi`` (edge, children = queries), ``out`` (deterministic value).

    Reference:
        McCarter sec. 2.1 (eqs. 1-5).
    """
    q = features(q, "q", "idw_attention")
    keys = features(keys, "keys", "idw_attention")
    values = features(values, "values", "idw_attention")
    if values.shape[-2] != keys.shape[-2]:
        raise ValueError(
            f"idw_attention: {keys.shape[-2]} keys but {values.shape[-2]} values; one value per prototype"
        )
    with numpyro.plate("queries", q.shape[-2]):
        phi = edge("phi", priors.Uniform(keys.shape[-2]), _score(q, keys, score, p, eps, sigma))
        numpyro.deterministic("out", values[phi])


def special_case_eta(
    q: jax.Array, keys: jax.Array, values: jax.Array, c: int, p: float = 2.0, eps: float = 1e-3
) -> jax.Array:
    r"""The smallest value weight $\eta$ that makes IDW predict class ``c`` at ``q`` (eq. 7).

    That is, once the prototype $k' = q$ with value $v' = \eta e_c$ is added (McCarter
    eq. 7):

    $$
    \eta = \Big(1 + \epsilon \sum_j \frac{1}{\epsilon + d_j^p}\Big)
    \Big[\max_{k \ne c} \sigma([d; 0])_{1:P} V_{:,k} - \sigma([d; 0])_{1:P} V_{:,c}\Big]
    $$

    where $\sigma([d; 0])$ is the IDW weighting (eq. 6) over the $P$ prototypes
    and the new one at distance 0 (weight $1/\epsilon$; the paper writes the new
    entry as $\epsilon$, the value of $\epsilon + d^p$ at $d = 0$). With
    this $\eta$ class ``c`` ties with the best other class; any larger $\eta$
    flips the prediction, any smaller does not. A non-positive $\eta$ means ``c`` is
    already predicted.

    Args:
        q: the special-case input ``(d,)``.
        keys: prototypes ``(P, d)``.
        values: prototype values $V$, ``(P, C)``.
        c: the class index.
        p: distance exponent $p$.
        eps: offset $\epsilon$.

    Returns:
        Scalar $\eta$.

    Raises:
        ValueError: if ``q`` is not one input ``(d,)``.
    """
    q, keys, values = jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values)
    if q.ndim != 1:
        raise ValueError(f"special_case_eta: q must be one input (d,), got {q.shape}")
    dist_p = jnp.sum((keys - q) ** 2, -1) ** (p / 2.0)
    w = 1.0 / (eps + dist_p)
    sigma = w / (jnp.sum(w) + 1.0 / eps)  # sigma([d; 0])_{1:P}
    out = sigma @ values
    others = jnp.where(jnp.arange(values.shape[-1]) == c, -jnp.inf, out)
    return (1.0 + eps * jnp.sum(w)) * (jnp.max(others) - out[c])


def augment_special_case(
    keys: jax.Array, values: jax.Array, q: jax.Array, c: int, eta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    r"""Append the prototype $k' = q$ with value $v' = \eta e_c$ (McCarter sec. 2.2).

    Args:
        keys: prototypes ``(P, d)``.
        values: prototype values ``(P, C)``.
        q: the special-case input ``(d,)``.
        c: the class index.
        eta: the value weight $\eta$ (e.g.
            [`special_case_eta`][structinfer.mechanisms.special_case_eta]).

    Returns:
        ``(keys, values)`` with ``P + 1`` rows.
    """
    keys, values = jnp.asarray(keys), jnp.asarray(values)
    v_new = eta * jax.nn.one_hot(c, values.shape[-1], dtype=values.dtype)
    return jnp.concatenate([keys, q[None].astype(keys.dtype)]), jnp.concatenate(
        [values, v_new[None]]
    )
