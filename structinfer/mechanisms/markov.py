r"""Markov edges: switching dynamics with a hidden Markov chain over the modes, and
monotonic alignment attention (Tschantz v2 sec. 7; Singh & Buckley sec. 3).

Each model is a ``numpyro.contrib.control_flow.scan`` over time whose step declares one
edge with a [`Markov`][structinfer.priors.Markov] prior: the scan's carry holds the
previous edge, which chooses the prior's row. The exact engine collapses the chain in
$O(T K^2)$ (funsor's parallel-scan sum-product, as NumPyro's own enumeration does);
[`structinfer.attention`][structinfer.attention] runs the expectation of ``out`` as a
fused forward-backward scan (`structinfer.lowering.markov`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro.contrib.control_flow import scan

from .. import priors
from .._checks import require
from ..primitives import edge, potential
from ._common import features

__all__ = ["markov_switching_dynamics", "monotonic_alignment"]


def markov_switching_dynamics(
    x: jax.Array,
    A: jax.Array,
    b: jax.Array,
    precisions: jax.Array,
    log_transition: jax.Array,
    log_initial: jax.Array,
) -> None:
    r"""Switching linear dynamical system whose active mode is a hidden Markov chain.

    Graph:
        a time series $x_{1..T}$; child $x_{t+1}$, parents the $K$ modes
        $(A_k, b_k)$ applied to $x_t$; one edge $\phi_t$ per transition, each coupled to
        the previous one.

    Prior:
        Markov, $p(\phi_1 = k) = \mathrm{softmax}(\lambda)_k$,
        $p(\phi_t = k \mid \phi_{t-1} = j) = \mathrm{softmax}_k(L_{jk})$.

    Potentials:
        Gaussian, $\log\mathcal N(x_{t+1};\, A_k x_t + b_k,\, \mathrm{diag}(\Lambda_k)^{-1})$.

    Value:
        the smoothed one-step prediction $\mathbb E[A_{\phi_t} x_t + b_{\phi_t}]$
        (``out``), the smoothed modes $p(\phi_t = k \mid x_{1..T})$ (forward-backward)
        and $\log Z = \log p(x_{2..T} \mid x_1)$ (the forward algorithm).

    Args:
        x: the time series ``(T, d)``, ``T >= 2``.
        A: mode dynamics $A_k$, ``(K, d, d)``.
        b: mode offsets $b_k$, ``(K, d)``.
        precisions: diagonal precisions $\Lambda_k$, ``(K, d)``, positive and finite
            (an error on concrete values, NaN under ``jit``).
        log_transition: $L$, ``(K, K)`` unnormalised log-weights (row: the previous
            mode); each row is normalised.
        log_initial: $\lambda$, ``(K,)`` unnormalised log-weights of the first mode.

    Sites:
        ``mode`` (Markov edge, time first: ``marginals(...)["mode"]`` is ``(T-1, K)``),
        ``x`` (the observed $x_{t+1}$, one Gaussian per transition), ``out``
        (deterministic, ``(T-1, d)``: the mode's prediction $A_{\phi_t} x_t + b_{\phi_t}$).

    Reference:
        Tschantz, "log-sum-exp energies" v2 sec. 7 (switching systems; the mode as a
        hidden Markov chain) and the slides' open questions.
    """
    x = features(x, "x", "markov_switching_dynamics")
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"markov_switching_dynamics: x must be (T >= 2, d), got {tuple(x.shape)}")
    d = x.shape[-1]
    A, b, precisions = jnp.asarray(A), jnp.asarray(b), jnp.asarray(precisions)
    if A.ndim != 3 or A.shape[1:] != (d, d):
        raise ValueError(f"markov_switching_dynamics: A must be (K, {d}, {d}), got {tuple(A.shape)}")
    k = A.shape[0]
    for name, arr in (("b", b), ("precisions", precisions)):
        if arr.shape != (k, d):
            raise ValueError(
                f"markov_switching_dynamics: {name} must be (K, d) = ({k}, {d}), got "
                f"{tuple(arr.shape)}"
            )
    if jnp.shape(log_transition) != (k, k):
        raise ValueError(
            f"markov_switching_dynamics: log_transition must be (K, K) = ({k}, {k}) for the "
            f"{k} modes of A, got {tuple(jnp.shape(log_transition))}"
        )
    precisions = require(lambda xp, p: (p > 0) & (p < xp.inf),
                         "markov_switching_dynamics: precisions must be positive and finite "
                         "(each mode's diagonal noise precisions), got {}", precisions)
    prior = priors.Markov(log_transition, log_initial)
    scale = jax.lax.rsqrt(precisions)

    def step(previous, pair):
        x_prev, x_next = pair
        z = edge("mode", prior, previous=previous)
        loc = jnp.einsum("...de,e->...d", A[z], x_prev) + b[z]
        numpyro.sample("x", dist.Normal(loc, scale[z]).to_event(1), obs=x_next)
        numpyro.deterministic("out", loc)
        return z, None

    scan(step, jnp.asarray(-1), (x[:-1], x[1:]))


def monotonic_alignment(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    log_stay: jax.Array | float = 0.0,
    log_advance: jax.Array | float = 0.0,
    log_skip: jax.Array | float | None = None,
    end: bool = True,
    log_leak: float = -30.0,
) -> None:
    r"""Monotonic alignment attention: each child keeps its parent or moves on by one.

    Graph:
        children (output frames) $t = 1..T$ in order, each attending to one of $M$
        parents (input tokens); the parents visited are non-decreasing in $t$.

    Prior:
        Markov: $\phi_1 = 0$; $p(\phi_t = j \mid \phi_{t-1} = i) \propto
        e^{\ell_s}[j = i] + e^{\ell_a}[j = i + 1] + e^{\ell_k}[j = i + 2]$ (stay, advance,
        optionally skip; the last parent can only stay); with ``end``, $\phi_T = M - 1$.
        Every other move has the log-weight $\ell_0$ = ``log_leak`` (a probability
        $\approx 10^{-13}$ per step by default, below float32 resolution).

    Potentials:
        dot product $q_t^\top k_j$.

    Value:
        $\mathbb E[v_{\phi_t}]$, the expected value of the aligned parent; the
        alignment posterior $p(\phi_t = j \mid q, k)$ (forward-backward) and its
        $\log Z$.

    Args:
        q: children (queries) ``(T, d)``.
        k: parents (keys) ``(M, d)``.
        v: parent values ``(M, d_v)``.
        log_stay: $\ell_s$, unnormalised log-weight of keeping the parent (a scalar, as
            are the other log-weights: one for every step).
        log_advance: $\ell_a$, of moving to the next parent.
        log_skip: $\ell_k$, of skipping one parent; ``None``: no skips.
        end: require the last child to take the last parent (then ``T`` must be at
            least the number of moves needed to reach it).
        log_leak: $\ell_0$, the log-weight of a non-monotone move (and of starting or
            ending elsewhere); ``-inf`` forbids them.

    Sites:
        ``align`` (Markov edge, children first: ``marginals(...)["align"]`` is
        ``(T, M)``), ``out`` (deterministic, ``(T, d_v)``).

    Reference:
        Singh & Buckley sec. 3 (priors over edges: here one that couples consecutive
        children); monotonic alignment as in speech and text-to-speech alignment and
        structured attention (Kim et al. 2017).
    """
    q = features(q, "q", "monotonic_alignment")
    k = features(k, "k", "monotonic_alignment")
    v = features(v, "v", "monotonic_alignment")
    if q.shape[-1] != k.shape[-1] or k.shape[0] != v.shape[0]:
        raise ValueError(
            "monotonic_alignment: expected q (T, d), k (M, d), v (M, d_v), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    weights = {"log_stay": log_stay, "log_advance": log_advance, "log_skip": log_skip,
               "log_leak": log_leak}
    for name, w in weights.items():
        if w is not None and jnp.ndim(w) != 0:
            raise ValueError(
                f"monotonic_alignment: `{name}` must be a scalar (one log-weight for every "
                f"step), got shape {tuple(jnp.shape(w))}"
            )
    m, t = k.shape[0], q.shape[0]
    dtype = jnp.result_type(q, k)
    i = jnp.arange(m)[:, None]
    j = jnp.arange(m)[None, :]
    neg = jnp.asarray(log_leak, dtype)
    lt = jnp.where(j == i, jnp.asarray(log_stay, dtype), neg)
    lt = jnp.where(j == i + 1, jnp.asarray(log_advance, dtype), lt)
    if log_skip is not None:
        lt = jnp.where(j == i + 2, jnp.asarray(log_skip, dtype), lt)
    initial = jnp.where(jnp.arange(m) == 0, jnp.asarray(0.0, dtype), neg)
    prior = priors.Markov(lt, initial)
    scores = q @ k.T  # (T, M)
    last = jnp.arange(t) == t - 1

    def step(previous, xs):
        score, is_last = xs
        z = edge("align", prior, score, previous=previous)
        if end:
            potential("align.end", jnp.where(is_last & (z != m - 1), neg, 0.0).astype(dtype))
        numpyro.deterministic("out", v[z])
        return z, None

    scan(step, jnp.asarray(-1), (scores, last))
