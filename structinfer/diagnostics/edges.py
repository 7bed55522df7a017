r"""Statistics of an edge posterior $A_{ij} = p(\phi_i = j \mid x)$ (the attention matrix).

Entropy per child $H_i = -\sum_j A_{ij}\log A_{ij}$, effective number of parents
$e^{H_i}$, expected distance $\sum_j A_{ij} d_{ij}$ with $d_{ij} = i + \text{offset} - j$
(child $i$ sits at parent position $i + \text{offset}$, the convention of
`structinfer.priors`), the effective window, the edge mass by distance, agreement of the
MAP edges with a known structure, and summaries of an InferenceData's `edge_posterior`
group and of the prior's hyper-parameters (e.g. the geometric $q$ of Singh & Buckley
sec. 5.2). The array functions are pure `jax.numpy` (jittable).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import NotFoundError, require
from ..priors import StructuralPrior
from ._common import check_marginals, check_true_edges, offset_of, var_name_list
from .data import xarray_name

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr

__all__ = [
    "edge_entropy",
    "effective_parents",
    "expected_distance",
    "effective_window",
    "distance_posterior",
    "EdgeAgreement",
    "edge_agreement",
    "edge_summary",
    "compare_edges",
    "hyperparameter_summary",
]


def _distances(marginals: jax.Array, offset: int) -> jax.Array:
    """`d[i, j] = i + offset - j` for the `(children, parents)` grid of `marginals`."""
    n, m = marginals.shape[-2:]
    return jnp.arange(n)[:, None] + offset - jnp.arange(m)[None, :]


def edge_entropy(marginals: jax.Array) -> jax.Array:
    r"""Entropy of each child's edge posterior, $H_i = -\sum_j A_{ij}\log A_{ij}$ (nats).

    Args:
        marginals: `(..., children, parents)`, rows summing to one.

    Returns:
        `(..., children)` in the marginals' dtype (16-bit marginals are summed in
        float32); 0 for a certain edge, $\log m$ for a uniform one.
    """
    a = check_marginals(marginals)
    return _entropy(a).astype(a.dtype)


def _entropy(a: jax.Array) -> jax.Array:
    """Each row's entropy, in float32 at least (16-bit terms summed in float32)."""
    acc = jnp.promote_types(a.dtype, jnp.float32)
    return jnp.sum(jax.scipy.special.entr(a.astype(acc)), axis=-1)


def effective_parents(marginals: jax.Array) -> jax.Array:
    r"""Effective number of parents $e^{H_i}$ (1 = one parent, $m$ = uniform).

    Args:
        marginals: `(..., children, parents)`, rows summing to one.

    Returns:
        `(..., children)` in the marginals' dtype (16-bit marginals: computed in
        float32, so $e^{H_i}$ is not that of a rounded $H_i$).
    """
    a = check_marginals(marginals)
    return jnp.exp(_entropy(a)).astype(a.dtype)


def expected_distance(marginals: jax.Array, offset: int | StructuralPrior = 0) -> jax.Array:
    r"""Posterior expected distance to the parent, $\sum_j A_{ij}(i + \text{offset} - j)$.

    Args:
        marginals: `(..., children, parents)`, rows summing to one.
        offset: an int, or the structural prior of the edge site (its `offset` is used).

    Returns:
        `(..., children)` in the marginals' dtype (16-bit marginals are summed in
        float32).
    """
    a = check_marginals(marginals)
    acc = jnp.promote_types(a.dtype, jnp.float32)  # 16-bit terms summed in float32
    d = _distances(a, offset_of(offset)).astype(acc)
    return jnp.sum(a.astype(acc) * d, axis=-1).astype(a.dtype)


def effective_window(
    marginals: jax.Array, offset: int | StructuralPrior = 0, mass: float = 0.9
) -> jax.Array:
    r"""Smallest window $w$ holding `mass` of each child's edge posterior.

    $$w_i = \min\{w \ge 0 : \textstyle\sum_{j : |d_{ij}| \le w} A_{ij} \ge \text{mass}\}$$

    (``mass`` is read as a fraction of the row's total, so a row summing to 1 only to its
    dtype's rounding has a window holding all of it).

    Args:
        marginals: `(..., children, parents)`, rows summing to one.
        offset: an int, or the structural prior of the edge site (its `offset` is used).
        mass: the posterior mass the window must hold, in `(0, 1]`.

    Returns:
        `(..., children)` in the marginals' dtype (16-bit marginals are summed in
        float32): whole numbers, NaN for a row that is
        not finite (a child with no allowed parent under `jit`) or, under `jit`, not
        probabilities (see below).

    Raises:
        ValueError: `mass` outside `(0, 1]` (traced: the windows are NaN), or
            (concrete) a row of `marginals` with a
            negative entry or not summing to 1 (under `jit` that row is NaN).
    """
    mass = require(lambda xp, m: (m > 0) & (m <= 1),
                   "effective_window: mass must lie in (0, 1], got {}", mass)
    offset = offset_of(offset)
    a = check_marginals(marginals)
    d = jnp.abs(_distances(a, offset))
    wmax = int(a.shape[-2] + a.shape[-1] + abs(offset))
    ws = jnp.arange(wmax + 1)
    # summed in float32 at least: a 16-bit running sum rounds a mass just short of
    # `mass` up to it (the window a step too small)
    acc = jnp.promote_types(a.dtype, jnp.float32)
    inside = (d[..., None] <= ws).astype(acc)  # (n, m, W)
    cum = jnp.einsum("...ij,ijw->...iw", a.astype(acc), inside)
    tol = 1e-6 if acc == jnp.float32 else 1e-12
    # `mass` of the row's own total (the largest window holds every parent): a row that
    # sums to 1 only to its dtype's rounding (as `check_marginals` accepts) still has a
    # window holding all of it
    held = cum >= mass * cum[..., -1:] - tol
    w = jnp.argmax(held, axis=-1).astype(a.dtype)
    ok = held[..., -1] & jnp.all(jnp.isfinite(a), axis=-1)
    return jnp.where(ok, w, jnp.asarray(jnp.nan, a.dtype))


def distance_posterior(
    marginals: jax.Array, offset: int | StructuralPrior = 0
) -> tuple[np.ndarray, jax.Array]:
    r"""Edge mass by distance, averaged over children: $p(d) = \frac1n\sum_i\sum_j A_{ij}[d_{ij}=d]$.

    Works for prior tables too (pass probabilities).

    Args:
        marginals: `(..., children, parents)`, rows summing to one.
        offset: an int, or the structural prior of the edge site (its `offset` is used).

    Returns:
        `(distances, probs)`: every value of $d_{ij}$ on the grid (ascending) and the
        mass at each, of shape `(..., len(distances))`, in the marginals' dtype
        (16-bit marginals are summed in float32).
    """
    offset = offset_of(offset)
    a = check_marginals(marginals)
    n, m = a.shape[-2:]
    ds = np.arange(-(m - 1) + offset, n - 1 + offset + 1)
    acc = jnp.promote_types(a.dtype, jnp.float32)  # 16-bit: summed and divided in float32
    onehot = (_distances(a, offset)[..., None] == jnp.asarray(ds)).astype(acc)
    return ds, (jnp.einsum("...ij,ijd->...d", a.astype(acc), onehot) / n).astype(a.dtype)


class EdgeAgreement(NamedTuple):
    """Agreement of the posterior edges with a known structure.

    Attributes:
        accuracy: fraction of children whose MAP parent (argmax of the marginals) is the
            true one; NaN when a child's row is not finite or (traced) its true parent
            is outside the parents.
        true_parent_prob: mean posterior probability of the true parent (NaN likewise
            for a true parent outside the parents).
        correct: `(..., children)` bool, MAP parent equals the true one (False for a
            row that is not finite or a true parent outside the parents).
    """

    accuracy: jax.Array
    true_parent_prob: jax.Array
    correct: jax.Array


def edge_agreement(marginals: jax.Array, true_edges: Any) -> EdgeAgreement:
    r"""Compare the MAP edges $\hat\phi_i = \arg\max_j A_{ij}$ with the true parents.

    For a model whose children are independent given the parameters, the joint MAP
    structure is the per-child argmax, so this is the MAP-structure agreement.

    Args:
        marginals: `(..., children, parents)`.
        true_edges: int `(..., children)`, the true parent of each child (its range is
            checked when concrete; traced, an index outside the parents makes both
            `accuracy` and `true_parent_prob` NaN, and its child not correct).

    Returns:
        An [`EdgeAgreement`][structinfer.diagnostics.EdgeAgreement].

    Raises:
        TypeError: `true_edges` is not integer.
        ValueError: `true_edges` has the wrong shape, or (concrete) an index outside the
            parents.
    """
    a = check_marginals(marginals)
    t = jnp.asarray(check_true_edges(true_edges, a))
    valid = (t >= 0) & (t < a.shape[-1])
    finite = jnp.all(jnp.isfinite(a), axis=-1)
    correct = (jnp.argmax(a, axis=-1) == t) & finite & valid
    # an index outside the parents reads NaN (take_along_axis would wrap a negative one)
    p_true = jnp.take_along_axis(a, jnp.where(valid, t, 0)[..., None], axis=-1)[..., 0]
    p_true = jnp.where(valid, p_true, jnp.nan)
    acc = jnp.promote_types(a.dtype, jnp.float32)  # a fraction of children, as precise
    accuracy = jnp.where(jnp.all(finite & valid), jnp.mean(correct, dtype=acc), jnp.nan)
    return EdgeAgreement(accuracy, jnp.mean(p_true), correct)


def edge_summary(
    idata: xr.DataTree, site: str | None = None, true_edges: Any = None, mass: float = 0.9
) -> dict[str, float]:
    """Scalar summaries of one edge site's posterior in an InferenceData.

    Args:
        idata: a DataTree with an `edge_posterior` group (from
            [`to_inference_data`][structinfer.diagnostics.to_inference_data]).
        site: the edge site (default: the only one), as the model names it (`"l1/phi"`
            under a `scope`) or as stored (`"l1::phi"`).
        true_edges: the true parent of each child (default: `<site>_true` when stored).
        mass: the mass of the effective window.

    Returns:
        `{name: value}`: mean entropy (nats), mean effective number of parents, mean
        expected distance, mean effective window and, with a true structure, the MAP
        accuracy and the mean probability of the true parent.

    Raises:
        ValueError: no `edge_posterior` group, or several edge sites and no `site`.
        KeyError: no edge site `site`.
    """
    if "edge_posterior" not in getattr(idata, "children", {}):
        raise ValueError("edge_summary: the InferenceData has no edge_posterior group")
    ds = idata["edge_posterior"].to_dataset()
    sites = [v for v in ds.data_vars if not v.endswith(("_prior", "_true"))]
    if site is None:
        if len(sites) != 1:
            raise ValueError(f"edge_summary: several edge sites {sites}; pass site=")
        site = sites[0]
    site = xarray_name(site)  # a scoped model's "l1/phi" is stored as "l1::phi"
    if site not in sites:
        raise NotFoundError(f"edge_summary: no edge site '{site}'; edge sites: {sites}")
    a = jnp.asarray(ds[site].values)
    offset = int(ds.attrs.get(f"{site}.offset", 0))
    out = {
        "entropy": float(jnp.mean(edge_entropy(a))),
        "effective_parents": float(jnp.mean(effective_parents(a))),
        "expected_distance": float(jnp.mean(expected_distance(a, offset))),
        "effective_window": float(jnp.mean(effective_window(a, offset, mass))),
    }
    if true_edges is None and f"{site}_true" in ds:
        true_edges = ds[f"{site}_true"].values
    if true_edges is not None:
        agr = edge_agreement(a, true_edges)
        out["map_accuracy"] = float(agr.accuracy)
        out["true_parent_prob"] = float(agr.true_parent_prob)
    return out


def compare_edges(
    idatas: Mapping[str, xr.DataTree], site: str | None = None, true_edges: Any = None
) -> pd.DataFrame:
    """[`edge_summary`][structinfer.diagnostics.edge_summary] of several models as a table.

    Args:
        idatas: `{model name: DataTree}`.
        site: the edge site (default: the only one of each model).
        true_edges: the true parent of each child (default: the stored `<site>_true`).

    Returns:
        A `pandas.DataFrame`, one row per model, sorted by MAP accuracy when a true
        structure is known.

    Raises:
        ValueError, KeyError: `edge_summary`'s error for one model (no `edge_posterior`
            group, several edge sites and no `site`, no edge site `site`), naming it.
    """
    import pandas as pd

    rows = {}
    for n, dt in idatas.items():
        try:
            rows[n] = edge_summary(dt, site=site, true_edges=true_edges)
        except (ValueError, KeyError) as err:
            msg = err.args[0] if err.args else str(err)
            kind = NotFoundError if isinstance(err, KeyError) else type(err)
            raise kind(f"compare_edges: model '{n}': {msg}") from err
    df = pd.DataFrame.from_dict(rows, orient="index")
    if "map_accuracy" in df:
        df = df.sort_values(["map_accuracy", "true_parent_prob"], ascending=False)
    return df


def hyperparameter_summary(
    idata: xr.DataTree, var_names: Sequence[str], round_to: int | str = "none"
) -> pd.DataFrame:
    r"""Posterior summary of the prior's hyper-parameters (e.g. the geometric $q$).

    Wraps `arviz_stats.summary`: mean, sd, interval, ESS and $\hat R$.

    Args:
        idata: a DataTree with a `posterior` group.
        var_names: the posterior variables to summarise (one name, or a list).
        round_to: decimals, or `"none"` for raw numbers.

    Returns:
        ArviZ's summary table (a `pandas.DataFrame`, one row per variable).

    Raises:
        KeyError: a variable is not in the posterior.
    """
    import arviz_stats as azs

    var_names = var_name_list(var_names)
    post = idata["posterior"].to_dataset()
    missing = [v for v in var_names if v not in post]
    if missing:
        raise NotFoundError(
            f"hyperparameter_summary: {missing} not in the posterior; variables: "
            f"{list(post.data_vars)}"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        return azs.summary(idata, var_names=var_names, round_to=round_to)
