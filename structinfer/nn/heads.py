r"""Ready-made mechanisms for [`Attention`][structinfer.nn.Attention]: one model per prior.

Each factory returns a NumPyro model ``mechanism(q, k, v)`` of all the heads of one
sequence: ``q`` is ``(heads, n, d)``, ``k`` and ``v`` are ``(heads, m, d)``; the
queries are the last ``n`` of the ``m`` positions (``offset = m - n``, so ``n = m``
is self attention; a head whose prior forbids later keys, every one but `uniform` and
`relative_position(causal=False)`, needs ``n <= m`` and says so otherwise). Every head's
children take one parent under the prior, with a
scaled dot-product score, and the value site ``"out"`` is the parent's value:

$$
\phi^h_i \sim p_\theta(\phi^h_i = j) \propto w_\theta(d_{ij}), \qquad
\psi^h_{ij} = \frac{q^h_i \cdot k^h_j}{\tau_h \sqrt d}, \qquad
\mathrm{out}^h_i = v^h_{\phi^h_i},
$$

with $d_{ij} = i + m - n - j$ the distance back from the query. The learnable
hyperparameters $\theta$ are ``numpyro.param`` sites (per head); the temperature
$\tau_h$ (``temperature=True``) is one more. Read a factory's source to write your
own mechanism: it is the whole of what the layer needs.

| factory | prior $p_\theta(\phi_i = j)$ | hyperparameters |
| --- | --- | --- |
| `uniform` | $1/m$ (``flax.nnx.MultiHeadAttention``) | — |
| `causal` | uniform over $d \ge 0$ | — |
| `window` | uniform over $0 \le d < w$ ($w$ static) | — |
| `relative_position` | $\propto e^{b_h(\min(d, D))}$, $d \ge 0$ | ``bias`` $(H, 2D+1)$ |
| `geometric` | $\propto q_h (1-q_h)^{d}$, $d \ge 0$ | ``q`` $(H, 1)$ in $(0, 1)$ |
| `geometric_beta` | $\propto B(\alpha_h + 1, \beta_h + d)$, $d \ge 0$ | ``alpha``, ``beta`` $(H, 1)$ |

Reference:
    Singh & Buckley, "Attention as implicit structural inference", Table 1
    (rows 2-4 and 12), appendix 8.2 (relative position) and sec. 5.2 (geometric).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.distributions import constraints
from numpyro.ops.indexing import Vindex

from .. import priors, scores
from .._checks import check_count, float32_at_least, is_concrete, require
from ..primitives import edge

__all__ = [
    "uniform",
    "causal",
    "window",
    "relative_position",
    "geometric",
    "geometric_beta",
    "beta_geometric_log_pmf",
]

Mechanism = Callable[[jax.Array, jax.Array, jax.Array], None]


def _check_values(x, who: str, what: str, ok: Callable, expected: str):
    """``x`` with its values checked by `require`: a concrete value outside its domain (NaN
    included) raises, naming the function and the argument; a traced one (a factory called
    under ``jit`` or ``grad``) becomes NaN, so the answer and its gradient are NaN, never a
    finite wrong number. ``ok(xp, a)`` says which entries are in the domain."""
    if x is None:
        raise ValueError(f"{who}: {what} {expected}, got None")
    if is_concrete(x):  # a Python number stays one (a factory may run inside a trace)
        try:
            np.asarray(x, dtype=float)
        except (TypeError, ValueError):
            raise ValueError(f"{who}: {what} {expected}, got {x!r}") from None
    return require(ok, f"{who}: {what} {expected}, got {{}}", x)


def _positive(xp, a):
    return xp.isfinite(a) & (a > 0)


def _rate(xp, a):
    return xp.isfinite(a) & (a > 0) & (a < 1)


def _per_head(x, heads: int, dtype, who: str, what: str) -> jax.Array:
    """An initial value ``x`` (a scalar, or one per head) as ``(heads, 1)``, or an error
    naming the argument and the shape it must broadcast to."""
    x = jnp.asarray(x, dtype)
    try:
        return jnp.broadcast_to(x, (heads, 1))
    except ValueError:
        raise ValueError(
            f"{who}: {what} of shape {tuple(x.shape)} must broadcast to (heads, 1) = "
            f"({heads}, 1): a scalar, or one value per head as a column (e.g. "
            f"jnp.asarray({what})[:, None])") from None


def _heads(q: jax.Array, k: jax.Array, v: jax.Array, who: str) -> tuple[int, int, int]:
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"{who}: q, k, v must be (heads, length, head_dim), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    H, n, _ = q.shape
    m = k.shape[-2]
    if k.shape[0] != H or v.shape[:2] != (H, m) or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{who}: k {tuple(k.shape)} and v {tuple(v.shape)} must be (heads={H}, m, d) with "
            f"the query's head_dim {q.shape[-1]}"
        )
    return H, n, m


def _check_no_later_keys(n: int, m: int, who: str) -> None:
    """Refuse more queries than keys for a head whose prior forbids later keys ($d < 0$):
    the queries are the last ``n`` of the ``m`` positions, so the first ``n - m`` would
    have no key at all (their rows empty whatever the prior's parameters)."""
    if n > m:
        raise ValueError(
            f"structinfer.nn.{who}: {n} queries but only {m} keys: the queries are the last "
            f"{n} positions of the keys' sequence (query i at key position i - {n - m}), and "
            f"this head allows only keys at or before a query, so the first {n - m} "
            "queries have no key at or before them; give at least as many keys as queries "
            "(e.g. the keys of the whole sequence), or use structinfer.nn.uniform() for "
            "cross attention over fewer keys"
        )


def _attend(prior: priors.StructuralPrior, q, k, v, temperature: bool) -> None:
    """The shared model body: one edge per (head, query), dot-product score, value read."""
    H, n, d = q.shape
    if temperature:
        tau = numpyro.param(
            "temperature", jnp.ones((H, 1, 1), q.dtype), constraint=constraints.positive
        )
        q = q / tau.astype(q.dtype)  # a float32 tau would make the score (and kernel) float32
    with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
        j = edge("phi", prior, scores.Dot(q, k, scale=d**-0.5))
        numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])


def _named(fn: Mechanism, name: str, doc: str) -> Mechanism:
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


def uniform(*, temperature: bool = False) -> Mechanism:
    r"""Uniform prior over all $m$ keys: transformer attention, $p(\phi_i = j) = 1/m$.

    Args:
        temperature: learn a per-head temperature $\tau_h > 0$ (``numpyro.param``
            ``"temperature"``, init 1).

    Returns:
        ``mechanism(q, k, v)``; the layer built from it equals
            ``flax.nnx.MultiHeadAttention`` with the same weights.
    """

    def mechanism(q, k, v):
        H, n, m = _heads(q, k, v, "uniform")
        _attend(priors.Uniform(m, offset=m - n), q, k, v, temperature)

    return _named(mechanism, "uniform", "Uniform prior over all keys (S&B Table 1 row 2).")


def causal(*, temperature: bool = False) -> Mechanism:
    r"""Causal prior: uniform over the keys at or before the query, $d \ge 0$.

    Args:
        temperature: learn a per-head temperature (see [`uniform`][structinfer.nn.uniform]).

    Returns:
        ``mechanism(q, k, v)``; the layer equals ``flax.nnx.MultiHeadAttention`` with a
            causal mask. Called with more queries than keys it raises ``ValueError``
            (the first queries would have no key at or before them).
    """

    def mechanism(q, k, v):
        H, n, m = _heads(q, k, v, "causal")
        _check_no_later_keys(n, m, "causal")
        _attend(priors.Restricted.causal(n, m, offset=m - n), q, k, v, temperature)

    return _named(mechanism, "causal", "Causal uniform prior (S&B Table 1 row 3).")


def window(size: int, *, temperature: bool = False) -> Mechanism:
    r"""Sliding-window prior: uniform over the ``size`` most recent keys, $0 \le d < w$.

    The window is static (it sets the kernel's distance band, so blocks outside it
    are skipped); compare windows as separate layers.

    Args:
        size: the window $w \ge 1$, counting the query's own position.
        temperature: learn a per-head temperature (see [`uniform`][structinfer.nn.uniform]).

    Returns:
        ``mechanism(q, k, v)``, named ``window_<size>``.

    Raises:
        ValueError: ``size`` is not an int $\ge 1$.
    """
    size = check_count(size, "window: size")

    def mechanism(q, k, v):
        H, n, m = _heads(q, k, v, "window")
        _check_no_later_keys(n, m, "window")
        _attend(priors.Restricted.window(n, size, m, offset=m - n), q, k, v, temperature)

    return _named(mechanism, f"window_{size}", f"Causal sliding window of {size} keys.")


def relative_position(
    max_distance: int, *, causal: bool = True, temperature: bool = False
) -> Mechanism:
    r"""Learned relative-position prior: $\log p(\phi_i = j) = b_h(\mathrm{clip}(d, -D, D)) + c$.

    A categorical prior that depends on the distance only (S&B appendix 8.2): one
    learnable log-weight per head and distance bucket, distances beyond $D$ sharing
    the last bucket (so the parameter count does not depend on the sequence length).

    Args:
        max_distance: $D \ge 0$; ``numpyro.param`` ``"bias"`` has shape ``(heads, 2D + 1)``
            (index ``clip(d, -D, D) + D``), initialised to 0 (uniform).
        causal: forbid later keys ($d < 0$); their buckets are then unused.
        temperature: learn a per-head temperature (see [`uniform`][structinfer.nn.uniform]).

    Returns:
        ``mechanism(q, k, v)`` with the ``numpyro.param`` ``"bias"``.

    Raises:
        ValueError: ``max_distance`` is not an int $\ge 0$.

    Reference:
        Singh & Buckley appendix 8.2 (relative position).
    """
    max_distance = check_count(max_distance, "relative_position: max_distance", 0)

    def mechanism(q, k, v):
        H, n, m = _heads(q, k, v, "relative_position")
        if causal:
            _check_no_later_keys(n, m, "relative_position")
        bias = numpyro.param("bias", jnp.zeros((H, 2 * max_distance + 1), q.dtype))
        prior = priors.RelativePosition(
            bias, m, offset=m - n, max_distance=max_distance, causal=causal
        )
        _attend(prior, q, k, v, temperature)

    return _named(
        mechanism, "relative_position", f"Learned relative-position prior (D={max_distance})."
    )


def geometric(
    q: float = 0.1, *, max_distance: int | None = None, temperature: bool = False
) -> Mechanism:
    r"""Geometric (recency) prior with a learnable rate per head, $p(\phi_i = j) \propto q_h (1 - q_h)^{d}$.

    Over $d \ge 0$, renormalised over the keys that exist
    ([`Geometric`][structinfer.priors.Geometric]; S&B sec. 5.2).

    The expected distance is $(1-q)/q$; the window holding 95 % of the prior mass is
    $\lceil \ln 0.05 / \ln(1-q) \rceil$.

    Args:
        q: initial rate in (0, 1) (a float, or an array broadcasting to ``(heads, 1)``);
            the ``numpyro.param`` ``"q"`` (constraint ``unit_interval``: the layer
            learns its logit).
        max_distance: optional static truncation $d \le D$ (the windowed kernel's band).
        temperature: learn a per-head temperature (see [`uniform`][structinfer.nn.uniform]).

    Returns:
        ``mechanism(q, k, v)`` with the ``numpyro.param`` ``"q"``.

    Raises:
        ValueError: a concrete ``q`` outside (0, 1) (a traced one makes the answer and
            its gradient NaN), or ``max_distance`` not ``None`` or an int $\ge 0$.

    Reference:
        Singh & Buckley sec. 5.2 (expanding attention).
    """
    q = _check_values(q, "geometric", "q", _rate, "must lie in (0, 1)")
    if max_distance is not None:
        max_distance = check_count(max_distance, "geometric: max_distance", 0)

    def mechanism(qq, k, v):
        H, n, m = _heads(qq, k, v, "geometric")
        _check_no_later_keys(n, m, "geometric")
        rate = numpyro.param(
            "q",
            _per_head(q, H, qq.dtype, "geometric", "q"),
            constraint=constraints.unit_interval,
        )
        prior = priors.Geometric(rate, m, offset=m - n, max_distance=max_distance)
        _attend(prior, qq, k, v, temperature)

    return _named(mechanism, "geometric", "Geometric recency prior with a learned rate q.")


def beta_geometric_log_pmf(alpha: jax.Array, beta: jax.Array, size: int) -> jax.Array:
    r"""The beta-geometric log-pmf $\log p(d) = \log B(\alpha+1, \beta+d) - \log B(\alpha, \beta)$.

    For $d = 0, \dots,$ ``size - 1``, by the ratio $p(d)/p(d-1) = 1 - (\alpha+1)/(\alpha+\beta+d)$ and $p(0) = \alpha/(\alpha+\beta)$,
    a cumulative sum of small terms: no difference of large log-gammas (which loses
    float32 precision at long distances; ``jax.scipy.special.betaln`` is also off by
    ~1e-6 in float64 for some arguments above 8).

    Args:
        alpha: Beta parameter (> 0), shape ``(..., 1)``.
        beta: Beta parameter (> 0), broadcasting with ``alpha``.
        size: number of distances.

    Returns:
        ``(..., size)``, $\log p(0), \dots, \log p(\text{size} - 1)$; in float32 for
            16-bit parameters.

    Raises:
        ValueError: a concrete ``alpha`` or ``beta`` that is not positive and finite
            (a traced one, under ``jit`` or ``grad``, makes the result and its gradient
            NaN), or ``size`` not an int $\ge 1$.
    """
    who = "beta_geometric_log_pmf"
    size = check_count(size, f"{who}: size")
    alpha = _check_values(alpha, who, "alpha", _positive, "must be positive and finite")
    beta = _check_values(beta, who, "beta", _positive, "must be positive and finite")
    # 16-bit parameters: summed in float32 (as every prior's table of 16-bit parameters)
    alpha, beta = float32_at_least(jnp.asarray(alpha)), float32_at_least(jnp.asarray(beta))
    t = jnp.arange(1, size, dtype=jnp.result_type(alpha, beta))
    steps = jnp.log1p(-(alpha + 1.0) / (alpha + beta + t))
    first = jnp.log(alpha) - jnp.log(alpha + beta)
    return first + jnp.concatenate([jnp.zeros_like(first), jnp.cumsum(steps, -1)], axis=-1)


def geometric_beta(
    alpha: float = 1.0, beta: float = 1.0, *, temperature: bool = False
) -> Mechanism:
    r"""Geometric × Beta prior, with each query's rate $q_i$ integrated out (collapsed).

    $$
    q_i \sim \mathrm{Beta}(\alpha_h, \beta_h),\quad p(\phi_i = j \mid q_i) = q_i (1-q_i)^{d_{ij}}
    \;\Longrightarrow\;
    p(\phi_i = j) = \int_0^1 q (1-q)^{d}\, \mathrm{Beta}(q; \alpha, \beta)\, dq
    = \frac{B(\alpha + 1, \beta + d)}{B(\alpha, \beta)},\; d \ge 0,
    $$

    the beta-geometric distribution (renormalised over the keys that exist). The
    geometric is the untruncated one, so the Beta is conjugate and the edge posterior
    $p(\phi_i = j \mid x) \propto e^{\psi_{ij}} B(\alpha+1, \beta+d_{ij})$ is exact — the
    fixed point that [`structinfer.infer.geometric_beta`][structinfer.infer.geometric_beta]
    approaches by mean field.
    Its tail decays like $d^{-(\alpha+1)}$, heavier than any geometric. Written as a
    [`RelativePosition`][structinfer.priors.RelativePosition] bias, so it lowers like one;
    $(\alpha_h, \beta_h)$ are learned (type-II maximum likelihood, ``numpyro.param``
    ``"alpha"``, ``"beta"``, positive).

    The posterior mean rate of query $i$ is
    $\mathbb E[q_i \mid x] = \sum_j p(\phi_i = j \mid x)\,(\alpha+1)/(\alpha+\beta+1+d_{ij})$.

    Args:
        alpha: initial Beta parameter $\alpha > 0$ (a float or an array broadcasting to
            ``(heads, 1)``). The prior mean rate is $\alpha/(\alpha+\beta)$.
        beta: initial Beta parameter $\beta > 0$, likewise.
        temperature: learn a per-head temperature (see [`uniform`][structinfer.nn.uniform]).

    Returns:
        ``mechanism(q, k, v)`` with the ``numpyro.param`` sites ``"alpha"``, ``"beta"``.

    Raises:
        ValueError: a concrete ``alpha`` or ``beta`` that is not positive and finite
            (a traced one, under ``jit`` or ``grad``, makes the answer and its gradient
            NaN).

    Reference:
        Singh & Buckley sec. 5.2 and appendix 7.3 (expanding attention).
    """
    alpha = _check_values(alpha, "geometric_beta", "alpha", _positive,
                          "must be positive and finite")
    beta = _check_values(beta, "geometric_beta", "beta", _positive, "must be positive and finite")

    def mechanism(q, k, v):
        H, n, m = _heads(q, k, v, "geometric_beta")
        _check_no_later_keys(n, m, "geometric_beta")
        pos = constraints.positive
        a = numpyro.param("alpha", _per_head(alpha, H, q.dtype, "geometric_beta", "alpha"),
                          constraint=pos)
        b = numpyro.param("beta", _per_head(beta, H, q.dtype, "geometric_beta", "beta"),
                          constraint=pos)
        # bias[h, d + m - 1] for d = -(m-1) .. m-1 (offset m - n puts the last query at
        # distance m - 1 from the first key); d < 0 is forbidden by causal=True (bias 0)
        bias = jnp.concatenate([jnp.zeros((H, m - 1), q.dtype), beta_geometric_log_pmf(a, b, m)],
                               axis=-1)
        prior = priors.RelativePosition(bias, m, offset=m - n, causal=True)
        _attend(prior, q, k, v, temperature)

    return _named(
        mechanism, "geometric_beta", "Geometric prior with a Beta-distributed rate, collapsed."
    )
