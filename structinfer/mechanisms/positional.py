r"""Positional encodings as priors and potentials (Singh & Buckley appendix 8.2,
Table 1 rows 4-5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
from jax.typing import DTypeLike

from .. import priors, scores
from ..primitives import edge
from ._common import check_matrix, features, project

__all__ = [
    "relative_position_attention",
    "absolute_position_attention",
    "sinusoidal_encoding",
    "RELATIVE_PARAMETERISATIONS",
]

RELATIVE_PARAMETERISATIONS = {
    "categorical": "(n, n) free log-prior matrix ln P",
    "relative": "(2n - 1,) one log-weight per distance i - j",
    "circulant": "(n,) log-weights c with ln P = circ(c)",
    "hartley": "(K,) Hartley coefficients beta",
}
"""The parameterisations of
[`relative_position_attention`][structinfer.mechanisms.relative_position_attention]'s prior
and the shape of ``theta`` each takes."""


def _relative_prior(theta: jax.Array, n: int, parameterisation: str) -> priors.StructuralPrior:
    if parameterisation == "categorical":
        if theta.shape != (n, n):
            raise ValueError(
                f"relative_position_attention: categorical theta must be ({n}, {n}), got {theta.shape}"
            )
        return priors.Categorical(theta)
    if parameterisation == "relative":
        if theta.shape != (2 * n - 1,):
            raise ValueError(
                f"relative_position_attention: relative theta must be ({2 * n - 1},), got {theta.shape}"
            )
        return priors.RelativePosition(theta, n)
    if parameterisation == "circulant":
        if theta.shape != (n,):
            raise ValueError(
                f"relative_position_attention: circulant theta must be ({n},), got {theta.shape}"
            )
        return priors.RelativePosition.circulant(theta)
    if parameterisation == "hartley":
        if theta.ndim != 1:
            raise ValueError(
                f"relative_position_attention: hartley theta must be (K,), got {theta.shape}"
            )
        return priors.RelativePosition.hartley(theta, n)
    raise ValueError(
        f"relative_position_attention: unknown parameterisation {parameterisation!r}; "
        f"expected one of {sorted(RELATIVE_PARAMETERISATIONS)}"
    )


def relative_position_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array | None,
    theta: jax.Array,
    parameterisation: str = "hartley",
) -> None:
    r"""Relative positional encodings are a categorical prior over edges.

    Graph:
        nodes $K = Q = (x_1..x_n)$, directed edges; one edge site per node.

    Prior:
        categorical, $p(\phi_i = j) = P_{ij}$: a free matrix (``"categorical"``), a
        function of $i - j$ (``"relative"``), circulant $P = \mathrm{circ}(p)$
        (``"circulant"``), or Hartley-parameterised
        $\ln P_{ij} = \sum_k \beta_k [\cos k\theta_{ij} + \sin k\theta_{ij}]$,
        $\theta_{ij} = 2\pi (i-j)/n$ (``"hartley"``).

    Potentials:
        $\psi(x_i, x_j) = x_i^\top W_Q^\top W_K x_j$.

    Value:
        $v_i = W_V x_{\phi_i}$; the output is
        $\sum_j \mathrm{softmax}_j(x_i^\top W_Q^\top W_K x_j + \ln P_{ij}) W_V x_j$.

    Args:
        x: nodes ``(n, d_in)``.
        wq: query projection $W_Q$, ``(d_k, d_in)``.
        wk: key projection $W_K$, ``(d_k, d_in)``.
        wv: value projection $W_V$, ``(d_v, d_in)``, or ``None`` for the nodes themselves.
        theta: prior parameters, shape per
            [`RELATIVE_PARAMETERISATIONS`][structinfer.mechanisms.RELATIVE_PARAMETERISATIONS].
        parameterisation: one of ``"categorical"``, ``"relative"``, ``"circulant"``,
            ``"hartley"``.

    Sites:
        ``phi`` (edge), ``out`` (deterministic value).

    Reference:
        Singh & Buckley appendix 8.2 ("Relative Position Encodings"); the paper prints the
        Hartley angle as $(i-j)/(2\pi n)$, the standard angle $2\pi (i-j)/n$ is
        the one that makes $P$ circulant.
    """
    x = features(x, "x", "relative_position_attention")
    n = x.shape[-2]
    prior = _relative_prior(jnp.asarray(theta), n, parameterisation)
    check_matrix(wq, "wq", "relative_position_attention", x.shape[-1])
    check_matrix(wk, "wk", "relative_position_attention", x.shape[-1])
    values = project(
        x,
        None if wv is None else check_matrix(wv, "wv", "relative_position_attention", x.shape[-1]),
    )
    with numpyro.plate("nodes", n):
        phi = edge("phi", prior, scores.Bilinear(x, x, wq, wk))
        numpyro.deterministic("out", values[phi])


def sinusoidal_encoding(
    n: int, d: int, base: float = 10000.0, dtype: DTypeLike | None = None
) -> jax.Array:
    r"""The sinusoidal absolute position vectors $e_i$ of Vaswani et al., ``(n, d)``.

    $e_{i,2k} = \sin(i / b^{2k/d})$, $e_{i,2k+1} = \cos(i / b^{2k/d})$.

    Args:
        n: the number of positions.
        d: the vector size.
        base: the base $b$.
        dtype: the floating dtype (default JAX's default float).

    Returns:
        The vectors $e_i$ as rows, ``(n, d)``.
    """
    pos = jnp.arange(n, dtype=dtype or jnp.result_type(float))[:, None]
    k = jnp.arange(d)[None, :]
    angle = pos / base ** ((2 * (k // 2)) / d)
    return jnp.where(k % 2 == 0, jnp.sin(angle), jnp.cos(angle))


def absolute_position_attention(
    x: jax.Array,
    positions: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array | None = None,
) -> None:
    r"""Absolute positional encodings modify the edge potentials.

    Graph:
        nodes $K = Q = (x_1..x_n)$; one edge site per node.

    Prior:
        uniform.

    Potentials:
        $\psi(x_i, x_j) = \tilde x_i^\top W_Q^\top W_K \tilde x_j$ with
        $\tilde x_i = x_i + e_i$ (``positions``).

    Value:
        $v_i = W_V x_{\phi_i}$ (Table 1: the value uses the un-encoded node).

    Args:
        x: nodes ``(n, d_in)``.
        positions: position vectors $e_i$, ``(n, d_in)``
            (e.g. [`sinusoidal_encoding`][structinfer.mechanisms.sinusoidal_encoding]).
        wq: query projection $W_Q$, ``(d_k, d_in)``.
        wk: key projection $W_K$, ``(d_k, d_in)``.
        wv: value projection $W_V$, ``(d_v, d_in)``, or ``None`` for the nodes themselves.

    Sites:
        ``phi`` (edge), ``out`` (deterministic value).

    Reference:
        Singh & Buckley appendix 8.2 and Table 1 row 5.
    """
    x = features(x, "x", "absolute_position_attention")
    positions = features(positions, "positions", "absolute_position_attention")
    if positions.shape != x.shape:
        raise ValueError(
            f"absolute_position_attention: positions {tuple(positions.shape)} must match "
            f"x {tuple(x.shape)}"
        )
    check_matrix(wq, "wq", "absolute_position_attention", x.shape[-1])
    check_matrix(wk, "wk", "absolute_position_attention", x.shape[-1])
    values = project(
        x,
        None if wv is None else check_matrix(wv, "wv", "absolute_position_attention", x.shape[-1]),
    )
    xt = x + positions
    with numpyro.plate("nodes", x.shape[-2]):
        phi = edge("phi", priors.Uniform(x.shape[-2]), scores.Bilinear(xt, xt, wq, wk))
        numpyro.deterministic("out", values[phi])
