r"""Mean-field inference for the geometric × Beta prior — expanding attention
(Singh & Buckley sec. 5.2, appendix 7.3, Algorithm 3).

The model, for each query (child) $i$ with parents at step
$k_{ij} = d_{ij} - d_0 \in \{0, 1, \dots\}$ back from its first allowed parent
($d_{ij} = i + \text{offset} - j$, $d_0 = 0$ with the self-edge, 1 without):

$$
q_i \sim \mathrm{Beta}(\alpha_0, \beta_0), \qquad
p(\phi_i = j \mid q_i) = q_i (1 - q_i)^{k_{ij}}, \qquad
p(x \mid \phi_i = j) \propto e^{s_{ij}}.
$$

The geometric is the untruncated one (parents that do not exist have zero
likelihood), which is what makes the Beta conjugate. The exact posterior is
$p(\phi_i = j \mid x) \propto e^{s_{ij}}\, B(\alpha_0 + 1, \beta_0 + k_{ij})$.
Two iterative approximations with factors $r(\phi_i)\,\mathrm{Beta}(q_i; \alpha, \beta)$:

**exact conjugate mean field** (coordinate ascent on the ELBO, monotone):

$$
r_{ij} \propto \exp\!\big(s_{ij} + k_{ij}\,\mathbb E[\ln(1-q)]\big), \quad
\mathbb E[\ln(1-q)] = \psi(\beta) - \psi(\alpha + \beta), \qquad
\alpha = \alpha_0 + 1, \quad \beta = \beta_0 + \textstyle\sum_j r_{ij} k_{ij};
$$

**plug-in** (the paper's Algorithm 3):

$$
q_t = \frac{\alpha_t}{\alpha_t + \beta_t}, \quad
H_t = \Big\lceil \frac{\ln 0.05}{\ln(1 - q_t)} \Big\rceil, \quad
r_{ij} \propto e^{s_{ij} + k_{ij} \ln(1 - q_t)} [k_{ij} < H_t], \quad
\alpha_{t+1} = \alpha_t + 1, \quad \beta_{t+1} = \beta_t + \textstyle\sum_{k < H_t} r_{ij} k_{ij}.
$$

(Sec. 5.2 prints $q_t = \beta_t/(\alpha_t+\beta_t)$; the Beta mean of the
success probability, and Algorithm 3, use $\alpha_t/(\alpha_t+\beta_t)$.
Algorithm 3 prints the log-prior as $-k/H_t$; we use appendix 7.3's
$k \ln(1-q_t)$, "the posterior given $q_t$".) The plug-in accumulates
pseudo-counts every iteration, so it is not coordinate ascent on any fixed
objective; its reported energy is the collapsed energy at $q_t$.

Both run batched over any leading dims (batch, heads) and the queries, each
query stopping on its own; the final window $H$ of each query is returned.

``init``, ``step`` and ``run`` (exported as ``structinfer.infer.geometric_beta``) are
pure functions of a `GeoBetaState`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import betaln, digamma
from jax.typing import ArrayLike

from .._checks import (
    as_float_array,
    check_int,
    check_ndim,
    check_static_int,
    check_tol,
    check_value,
    float32_at_least,
    is_concrete,
    require,
)
from ..scores import Score
from ._loop import LoopInfo, check, run_loop

__all__ = ["GeoBetaState", "horizon", "geometric_beta_free_energy", "init", "step", "run"]


class GeoBetaState(NamedTuple):
    r"""State of [`geometric_beta`][structinfer.infer.geometric_beta]: the mean-field factors.

    The factors are $r(\phi_i)\,\mathrm{Beta}(q_i; \alpha, \beta)$, batch shape
    `(..., children)`.

    Attributes:
        attention: ``(..., children, parents)`` $r(\phi_i = j)$.
        alpha: ``(..., children)`` parameter $\alpha$ of the Beta factor of $q_i$.
        beta: ``(..., children)`` parameter $\beta$ of the Beta factor of $q_i$.
        window: ``(..., children)`` int32, the horizon $H$ (number of parents,
            counted back from the first allowed one) — the window each query used
            (plug-in) or would use at its final $\mathbb E[q]$ (exact).
        energy: ``(..., children)`` free energy of the current factors.
    """

    attention: jax.Array
    alpha: jax.Array
    beta: jax.Array
    window: jax.Array
    energy: jax.Array

    @property
    def mean_q(self) -> jax.Array:
        r"""The mean rate $\mathbb E[q_i] = \alpha / (\alpha + \beta)$ under the Beta factor."""
        return self.alpha / (self.alpha + self.beta)


def horizon(q: ArrayLike, mass: float = 0.95) -> jax.Array:
    r"""Truncation horizon $H(q) = \lceil \ln(1 - \text{mass}) / \ln(1 - q) \rceil \ge 1$.

    The number of geometric steps holding ``mass`` of the prior.

    Args:
        q: the geometric rate(s) in $(0, 1)$.
        mass: the prior mass to hold, in $(0, 1)$.

    Returns:
        $H(q)$, shaped like ``q`` (a float array of integer values; float32 for a
            16-bit ``q``, which could not hold them).

    Raises:
        ValueError: a ``q`` or ``mass`` outside $(0, 1)$ (concrete values; traced, the
            horizon is NaN).
        TypeError: ``q`` or ``mass`` is not a real number or array.

    Reference:
        Singh & Buckley app. 7.3 (expanding attention).
    """
    q = require(lambda xp, q: (q > 0) & (q < 1), "horizon: q must lie in (0, 1), got {}",
                float32_at_least(as_float_array(q, "horizon: q")))
    mass = require(lambda xp, m: (m > 0) & (m < 1), "horizon: mass must lie in (0, 1), got {}",
                   as_float_array(mass, "horizon: mass"))
    return _horizon(q, mass)


def _horizon(q: jax.Array, mass: Any) -> jax.Array:
    """`horizon` of a checked ``q`` and ``mass``."""
    h = jnp.ceil(jnp.log1p(-mass) / jnp.log1p(-q))
    return jnp.maximum(h, 1.0)


def _steps(n: int, m: int, offset: int, include_self: bool, max_distance):
    d = np.arange(n)[:, None] + offset - np.arange(m)[None, :]
    d0 = 0 if include_self else 1
    allowed = d >= d0
    if max_distance is not None:
        allowed &= d <= max_distance
    return np.where(allowed, d - d0, 0), allowed


def _beta_entropy(a, b):
    return (betaln(a, b) - (a - 1) * digamma(a) - (b - 1) * digamma(b)
            + (a + b - 2) * digamma(a + b))


def geometric_beta_free_energy(
    scores: ArrayLike,
    attention: ArrayLike,
    alpha: ArrayLike,
    beta: ArrayLike,
    alpha0: ArrayLike,
    beta0: ArrayLike,
    steps: ArrayLike,
    allowed: ArrayLike,
) -> jax.Array:
    r"""Mean-field free energy $-\mathrm{ELBO}$ per query.

    $$
    F = -\sum_j r_j\big(s_j + \mathbb E\ln q + k_j \mathbb E\ln(1-q)\big)
        - \mathbb E\ln \mathrm{Beta}(q;\alpha_0,\beta_0) + \sum_j r_j \ln r_j
        - \mathrm H[\mathrm{Beta}(\alpha,\beta)]
    \;\ge\; -\ln \sum_j e^{s_j} \frac{B(\alpha_0+1, \beta_0+k_j)}{B(\alpha_0,\beta_0)}.
    $$

    Args:
        scores: ``(..., children, parents)`` log-potentials $s_{ij}$ ($-\infty$: a
            parent of zero likelihood, which takes no attention).
        attention: ``(..., children, parents)`` $r(\phi_i = j)$.
        alpha: ``(..., children)`` parameter $\alpha$ of the Beta factor.
        beta: ``(..., children)`` parameter $\beta$ of the Beta factor.
        alpha0: the Beta hyper-prior's $\alpha_0$, broadcasting against ``alpha``.
        beta0: the Beta hyper-prior's $\beta_0$, likewise.
        steps: ``(children, parents)`` steps $k_{ij}$ back from the first allowed parent.
        allowed: ``(children, parents)`` bool, the parents each query may take.

    Returns:
        $F$, ``(..., children)``; 16-bit inputs are computed, and answered, in float32.

    Reference:
        Singh & Buckley sec. 5.2 and appendix 7.3.
    """
    scores, attention, alpha, beta, alpha0, beta0 = (
        float32_at_least(as_float_array(x, f"geometric_beta_free_energy: {name}"))
        for name, x in (("scores", scores), ("attention", attention), ("alpha", alpha),
                        ("beta", beta), ("alpha0", alpha0), ("beta0", beta0)))
    steps = jnp.asarray(steps)  # integer steps take the terms' dtype (not x64's default)
    if jnp.issubdtype(steps.dtype, jnp.floating):
        steps = float32_at_least(steps)
    elq = digamma(alpha) - digamma(alpha + beta)
    el1q = digamma(beta) - digamma(alpha + beta)
    r = jnp.where(allowed, attention, 0.0)
    # a parent of zero likelihood (s = -inf) without attention adds nothing (r * s would
    # be 0 * -inf = NaN); a finite or NaN score stays, so do dF/dr and a NaN
    s = jnp.where(allowed & ((r > 0) | (scores != -jnp.inf)), scores, 0.0)
    ek = jnp.sum(r * steps, -1)
    lik = jnp.sum(r * s, -1) + elq + ek * el1q
    prior = (alpha0 - 1) * elq + (beta0 - 1) * el1q - betaln(alpha0, beta0)
    ent_r = -jnp.sum(jnp.where(r > 0, r * jnp.log(jnp.where(r > 0, r, 1.0)), 0.0), -1)
    return -(lik + prior + ent_r + _beta_entropy(alpha, beta))


class _Problem(NamedTuple):
    """The scores and the parent layout, checked and cast once per call."""

    scores: jax.Array  # (..., children, parents)
    alpha0: jax.Array  # (..., children)
    beta0: jax.Array
    steps: jax.Array  # (children, parents) k_ij
    allowed: jax.Array  # (children, parents) bool


def _setup(scores, alpha0, beta0, method, include_self, offset, max_distance,
           mass) -> tuple[_Problem, Any]:
    """The problem and the checked `mass` (traced: NaN outside (0, 1))."""
    if method not in ("exact", "plugin"):
        raise ValueError(f"geometric_beta: method must be 'exact' or 'plugin', got {method!r}")
    offset = _static_int(offset, "offset")
    if max_distance is not None:
        max_distance = _static_int(max_distance, "max_distance")
    mass = require(lambda xp, m: (m > 0) & (m < 1),
                   "geometric_beta: mass must lie in (0, 1), got {}", mass)
    s = scores.dense() if isinstance(scores, Score) else as_float_array(scores, "geometric_beta: scores")
    s = float32_at_least(s)  # 16 bits would round the distances and the pseudo-counts
    check_ndim(s, 2, "geometric_beta: scores", "(..., children, parents)")
    if not is_concrete(mass):  # a NaN mass (outside (0, 1)) makes everything NaN
        s = s + (0 * mass).astype(s.dtype)
    n, m = s.shape[-2:]
    if m == 0:
        raise ValueError(f"geometric_beta: scores must be (..., children, parents) with at least "
                         f"one parent, got shape {tuple(s.shape)}")
    batch = s.shape[:-1]
    dtype = s.dtype
    a0, b0 = (jnp.asarray(v, dtype) for v in (alpha0, beta0))
    for name, v in (("alpha0", a0), ("beta0", b0)):
        try:
            fits = jnp.broadcast_shapes(v.shape, batch) == batch
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"geometric_beta: {name} of shape {v.shape} must broadcast "
                             f"against the scores' (..., children) shape {batch}")
    a0, b0 = jnp.broadcast_to(a0, batch), jnp.broadcast_to(b0, batch)
    # Beta(inf, .) is no distribution (its energy is NaN, then blamed on the scores)
    a0, b0 = (check_value(v, lambda xp, v: (v > 0) & xp.isfinite(v), f"geometric_beta: {name}",
                          "must be positive and finite")
              for name, v in (("alpha0", a0), ("beta0", b0)))
    steps_np, allowed_np = _steps(n, m, offset, include_self, max_distance)
    empty = ~allowed_np.any(-1)
    if empty.any():
        raise ValueError(
            f"geometric_beta: child {int(np.argmax(empty))} has no allowed parent "
            f"(include_self={include_self}, offset={offset}, max_distance={max_distance})"
        )
    return _Problem(s, a0, b0, jnp.asarray(steps_np, dtype), jnp.asarray(allowed_np)), mass


def _static_int(value: Any, name: str) -> int:
    """``value`` as a Python int: it sets the parent layout, so it cannot be traced, and a
    float or a bool is refused (as by the `Geometric` prior)."""
    check_static_int(value, name, "geometric_beta")
    return check_int(value, f"geometric_beta: {name}")


def _attend(p: _Problem, log_decay, window):
    mask = p.allowed if window is None else p.allowed & (p.steps < window[..., None])
    logits = jnp.where(mask, p.scores + p.steps * log_decay[..., None],
                       jnp.asarray(-jnp.inf, p.scores.dtype))
    return jax.nn.softmax(logits, -1), logits


def _factors(p: _Problem, alpha, beta, method: str, mass: float) -> GeoBetaState:
    """The attention, window and energy that the Beta factor (alpha, beta) implies."""
    if method == "exact":
        r, _ = _attend(p, digamma(beta) - digamma(alpha + beta), None)
        e = geometric_beta_free_energy(p.scores, r, alpha, beta, p.alpha0, p.beta0, p.steps,
                                       p.allowed)
        win = _horizon(alpha / (alpha + beta), mass).astype(jnp.int32)
        return GeoBetaState(r, alpha, beta, win, e)
    q = alpha / (alpha + beta)
    win = _horizon(q, mass)
    r, logits = _attend(p, jnp.log1p(-q), win)
    e = -jax.nn.logsumexp(logits + jnp.log(q)[..., None], -1)
    return GeoBetaState(r, alpha, beta, win.astype(jnp.int32), e)


def _default_tol(method: str, tol: float | None) -> float:
    return (1e-6 if method == "exact" else 1e-3) if tol is None else tol


def _step(p: _Problem, st: GeoBetaState, method: str, mass: float, tol: float):
    ek = jnp.sum(st.attention * p.steps, -1)
    if method == "exact":  # q-factor given r, then r given the q-factor
        alpha, beta = p.alpha0 + 1.0, p.beta0 + ek
    else:  # Algorithm 3: accumulate pseudo-counts
        alpha, beta = st.alpha + 1.0, st.beta + ek
    new = _factors(p, alpha, beta, method, mass)
    conv = (jnp.max(jnp.abs(new.attention - st.attention), -1) <= tol) & (
        new.window == st.window)
    return new, conv


def init(
    scores: ArrayLike | Score,
    alpha0: ArrayLike = 0.1,
    beta0: ArrayLike = 0.9,
    *,
    method: str = "exact",
    include_self: bool = True,
    offset: int = 0,
    max_distance: int | None = None,
    mass: float = 0.95,
) -> GeoBetaState:
    r"""The initial factors: $\mathrm{Beta}(\alpha_0, \beta_0)$ for $q$ and the attention it implies.

    Args:
        scores: `(..., children, parents)` log-potentials $s_{ij}$ or a
            [`Score`][structinfer.scores.Score]; 16-bit scores give a float32 state.
        alpha0: the Beta hyper-prior's $\alpha_0$, broadcasting against
            `(..., children)`.
        beta0: the Beta hyper-prior's $\beta_0$, likewise.
        method: `"exact"` (conjugate coordinate ascent) or `"plugin"` (Algorithm 3).
        include_self: the query's own position is a parent ($d_0 = 0$).
        offset: child $i$ sits at parent position $i + \text{offset}$.
        max_distance: optional largest distance $d_{ij}$ allowed.
        mass: prior mass kept by the horizon $H(q)$.

    Returns:
        The `GeoBetaState` before the first iteration.

    Raises:
        ValueError: as [`geometric_beta`][structinfer.infer.geometric_beta].
    """
    p, mass = _setup(scores, alpha0, beta0, method, include_self, offset, max_distance, mass)
    return _factors(p, p.alpha0, p.beta0, method, mass)


def step(
    scores: ArrayLike | Score,
    state: GeoBetaState,
    alpha0: ArrayLike = 0.1,
    beta0: ArrayLike = 0.9,
    *,
    method: str = "exact",
    include_self: bool = True,
    offset: int = 0,
    max_distance: int | None = None,
    mass: float = 0.95,
    tol: float | None = None,
) -> tuple[GeoBetaState, jax.Array]:
    r"""One mean-field iteration: the Beta factor given $r$, then $r$ given the Beta factor.

    Exact: $\alpha = \alpha_0 + 1$, $\beta = \beta_0 + \sum_j r_{ij}k_{ij}$, then the
    attention given the new factor. Plug-in (Algorithm 3): $\alpha \leftarrow \alpha + 1$,
    $\beta \leftarrow \beta + \sum_{k<H} r_{ij}k_{ij}$, then the windowed attention at
    $q = \alpha/(\alpha+\beta)$ (see the module docstring).

    Args:
        scores: `(..., children, parents)` log-potentials $s_{ij}$ or a
            [`Score`][structinfer.scores.Score]; 16-bit scores give a float32 state.
        state: the current `GeoBetaState`.
        alpha0: the Beta hyper-prior's $\alpha_0$.
        beta0: the Beta hyper-prior's $\beta_0$.
        method: `"exact"` or `"plugin"`.
        include_self: the query's own position is a parent ($d_0 = 0$).
        offset: child $i$ sits at parent position $i + \text{offset}$.
        max_distance: optional largest distance $d_{ij}$ allowed.
        mass: prior mass kept by the horizon $H(q)$.
        tol: the attention tolerance, a non-negative number (default `1e-6` exact,
            `1e-3` plug-in; anything else raises `ValueError`).

    Returns:
        `(new_state, converged)`, `converged` `(..., children)`: the attention moved by
            at most `tol` and the window stayed put.
    """
    tol = check_tol(_default_tol(method, tol), "geometric_beta: tol")
    p, mass = _setup(scores, alpha0, beta0, method, include_self, offset, max_distance, mass)
    return _step(p, state, method, mass, tol)


def run(
    scores: ArrayLike | Score,
    alpha0: ArrayLike = 0.1,
    beta0: ArrayLike = 0.9,
    *,
    method: str = "exact",
    include_self: bool = True,
    offset: int = 0,
    max_distance: int | None = None,
    mass: float = 0.95,
    tol: float | None = None,
    max_iters: int = 100,
    raise_on_nonfinite: bool = True,
) -> tuple[GeoBetaState, LoopInfo]:
    r"""Expanding attention: mean-field inference of the edges and the geometric rate.

    See the module docstring for the model and both updates.

    Args:
        scores: `(..., children, parents)` log-potentials $s_{ij}$ (e.g.
            `q k^T / sqrt(d)`) or a [`Score`][structinfer.scores.Score]; 16-bit scores
            are iterated, and answered, in float32 (as the exact engine contracts them).
        alpha0: the Beta hyper-prior's $\alpha_0$, broadcasting against
            `(..., children)` (the paper uses 0.1).
        beta0: the Beta hyper-prior's $\beta_0$, likewise (the paper uses 0.9).
        method: `"exact"` (conjugate coordinate ascent) or `"plugin"` (Algorithm 3).
        include_self: the query's own position is a parent ($d_0 = 0$; without it
            $d_0 = 1$), as in [`Geometric`][structinfer.priors.Geometric].
        offset: child $i$ sits at parent position $i + \text{offset}$, as in
            [`Geometric`][structinfer.priors.Geometric] (a Python int, not traced).
        max_distance: optional largest distance $d_{ij}$ allowed, as in
            [`Geometric`][structinfer.priors.Geometric] (a Python int, not traced).
        mass: prior mass kept by the horizon $H(q)$ (0.95 in the paper).
        tol: a query has converged when its attention moves by at most `tol` and its
            window stays put (default `1e-6` exact; `1e-3` plug-in, whose accumulating
            pseudo-counts move $q_t$ by $O(1/t)$ per step).
        max_iters: the most iterations (queries still moving are reported in
            `info.max_iters_reached`).
        raise_on_nonfinite: raise on a non-finite energy when the result is concrete.

    Returns:
        `(GeoBetaState, LoopInfo)`, both with batch shape `(..., children)`.
            `info.energy[..., t]` is the free energy after iteration `t` (`t = 0`: the
            prior factor $\mathrm{Beta}(\alpha_0, \beta_0)$) (exact: the mean-field
            $-\mathrm{ELBO}$, non-increasing; plug-in: the collapsed energy
            $-\ln\sum_{k<H_t} e^{s + \ln q_t + k\ln(1-q_t)}$).

    Raises:
        ValueError: an unknown `method`, `mass` outside (0, 1), non-positive or
            infinite `alpha0`/`beta0` (concrete values; traced, they become NaN and so
            does the energy), scores with no parents, a child with no allowed parent, or a `tol`
            that is not a non-negative number.

    Cost: $O(n m)$ per iteration on the cached scores.

    Reference:
        Singh & Buckley sec. 5.2, appendix 7.3 and Algorithm 3.
    """
    p, mass = _setup(scores, alpha0, beta0, method, include_self, offset, max_distance, mass)
    tol = check_tol(_default_tol(method, tol), "geometric_beta: tol")

    def body(st: GeoBetaState):
        new, conv = _step(p, st, method, mass, tol)
        return new, new.energy, conv

    state = _factors(p, p.alpha0, p.beta0, method, mass)
    state, info = run_loop(body, state, state.energy, max_iters, f"geometric_beta ({method})")
    if raise_on_nonfinite:
        check(info, f"geometric_beta ({method})", "edge scores (check them for NaN/inf)")
    return state, info
