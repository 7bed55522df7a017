r"""The statement models are written with: :func:`edge`.

.. math::

    \phi_i \sim p(\phi_i), \qquad \log p(x, \phi) \mathrel{+}= \psi(x_i, x_{\phi_i})

An edge site is an ordinary NumPyro ``sample`` site whose distribution is the
structural prior (a ``Categorical`` over parents) and which is marked for
parallel enumeration; the score is added as a ``factor`` site named
``"<name>.score"``. Run the model under :mod:`structinfer.exact` to collapse
the edges; run it plainly (``numpyro.handlers.seed``) to sample a structure
from the prior.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpyro
from numpyro.contrib.funsor.enum_messenger import plate as _enum_plate
from numpyro.ops.indexing import Vindex
from numpyro.primitives import _PYRO_STACK
from numpyro.primitives import plate as _plate

from ._checks import check_finite
from .priors import StructuralPrior, as_prior
from .scores import Score, as_score

__all__ = ["edge", "EdgeInfo", "gather", "SCORE_SUFFIX", "SCORE_TABLE_KEY"]

#: suffix of the factor site that carries an edge's score
SCORE_SUFFIX = ".score"
#: key of the edge site's ``infer`` dict holding its dense score table
SCORE_TABLE_KEY = "structinfer_score_table"


@dataclass(frozen=True)
class EdgeInfo:
    """What :func:`edge` records in the site's ``infer`` dict (key ``"structinfer"``).

    The lowered engine reads it to recognise dense patterns; users rarely need it.
    """

    name: str
    prior: StructuralPrior
    score: Score | None
    num_children: int
    num_parents: int
    children_plate: str
    #: the ``child=`` index this site follows (multi-hop), ``None`` for a plain edge
    child: Any = field(default=None, compare=False, repr=False)


def active_plates() -> list[Any]:
    """The plates (NumPyro's or funsor's enumeration plates) currently entered, outermost first."""
    return [h for h in _PYRO_STACK if isinstance(h, (_plate, _enum_plate))]


def gather(table: jax.Array, index: jax.Array) -> jax.Array:
    r"""``table[..., index]`` along the last (parent) axis, enumeration-safe.

    ``table`` has shape ``batch + (parents,)``; ``index`` any shape that broadcasts
    against ``batch`` when right-aligned (as an enumerated edge value does).
    This is :class:`numpyro.ops.indexing.Vindex` — plain chained indexing silently
    misaligns enumerated dims (numpyro issue 2252).

    .. math:: \text{out}[\ldots] = \text{table}[\ldots, \text{index}[\ldots]]

    It is how a value :math:`v_i(x, \phi_i = j) = V x_j` is read (Singh & Buckley
    sec. 3.2, the value function).
    """
    return Vindex(table)[..., index]


def _children_plate(name: str):
    plates = active_plates()
    if not plates:
        raise ValueError(
            f"structinfer.edge('{name}') must be called inside a numpyro.plate over its "
            "children, e.g. `with numpyro.plate('queries', n): si.edge(...)`"
        )
    for p in plates:
        if p.dim == -1:
            return p, plates
    dims = {p.name: p.dim for p in plates}
    raise ValueError(
        f"edge site '{name}': no plate at dim=-1 (plates: {dims}); the children plate "
        "must be the rightmost batch dim — pass dim=-1 to it, or enter it first"
    )


def _batch_shape(plates) -> tuple[int, ...]:
    nd = max(-p.dim for p in plates)
    shape = [1] * nd
    for p in plates:
        shape[p.dim] = p.subsample_size if getattr(p, "subsample_size", None) else p.size
    return tuple(shape)


def _check_table(table: jax.Array, what: str, site: str, batch, num_parents: int) -> None:
    shape = tuple(table.shape)
    if shape[-1] != num_parents:
        raise ValueError(
            f"edge site '{site}': {what} has {shape[-1]} parents (shape {shape}) but the "
            f"prior has {num_parents}"
        )
    lead = len(shape) - 1 - len(batch)
    if lead > 0 and any(s != 1 for s in shape[:lead]):
        raise ValueError(
            f"edge site '{site}': {what} of shape {shape} has more batch dims than the "
            f"plates around the edge (batch shape {tuple(batch)}); add a plate for each "
            "leading dim (e.g. heads)"
        )
    table_batch = shape[max(lead, 0) : -1]
    try:
        fits = jnp.broadcast_shapes(table_batch, tuple(batch)) == tuple(batch)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"edge site '{site}': {what} of shape {shape} does not fit the plates' batch "
            f"shape {tuple(batch)} + ({num_parents},): the layout is (..., children, parents) "
            "with children on the plate at dim=-1"
        )


def edge(name: str, prior, score=None, *, child=None, infer: dict | None = None) -> jax.Array:
    r"""Declare an edge site: child ``i`` takes one parent ``\phi_i`` under ``prior``.

    .. math::

        p(x, \phi) \propto \prod_i p(\phi_i)\, \exp \psi(x_i, x_{\phi_i})

    Must be called inside one or more ``numpyro.plate``; the plate at ``dim=-1``
    indexes the children. Extra plates (heads, batch) broadcast.

    Args:
        name: site name (must be unique in the model).
        prior: a :mod:`structinfer.priors` prior (or a NumPyro ``Categorical``).
        score: a :mod:`structinfer.scores` score, or a ``(..., children, parents)``
            array of log-potentials; ``None`` for no potential (e.g. when the
            parent enters through an observed sample site instead).
        child: follow a chain (multi-hop attention): the node whose edge this is, e.g.
            the value of a previous edge site. The site is then node ``child``'s edge
            with its posterior conditional
            :math:`p(\phi_{\text{child}} = k \mid x) = \mathrm{softmax}_k(\log p(\phi_{\text{child}} = k) + \psi_{\text{child},k})`
            as distribution (Singh & Buckley appendix 7.3: the second hop uses the
            edge of the node the first hop reached). No separate score factor is
            added: each hop is normalised, so ``log Z`` is that of the first hop.
        infer: extra ``infer`` entries for the sample site.

    Returns:
        The edge variable (parent index): shape = the plates' batch shape when the
        model is run plainly, an enumeration tensor under the exact engine.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"edge: name must be a non-empty str, got {name!r}")
    child_plate, plates = _children_plate(name)
    batch = _batch_shape(plates)
    num_children = batch[-1]
    prior = as_prior(prior, name)
    num_parents = prior.num_parents
    try:
        log_prior = prior.log_table(num_children)
    except ValueError as e:
        raise ValueError(f"edge site '{name}': {e}") from None
    _check_table(log_prior, "prior table", name, batch, num_parents)

    score_obj = None
    score_table = None
    if score is not None:
        score_obj = as_score(score, name)
        score_table = score_obj.dense()
        _check_table(score_table, "score", name, batch, num_parents)
        check_finite(score_table, f"edge site '{name}': score")

    info = EdgeInfo(name, prior, score_obj, num_children, num_parents, child_plate.name, child)
    site_infer = {"enumerate": "parallel", "structinfer": info}
    if score_table is not None and child is None:
        # read by the exact engine, which folds the score into the edge's own factor
        site_infer[SCORE_TABLE_KEY] = score_table
    if infer:
        site_infer.update(infer)
    if child is not None:
        # node `child`'s edge, with its exact posterior conditional as distribution
        logits = log_prior if score_table is None else log_prior + score_table
        logits = jnp.broadcast_to(logits, logits.shape[:-2] + (num_children, num_parents))
        rows = Vindex(logits)[..., child, :]
        return numpyro.sample(
            name,
            numpyro.distributions.Categorical(logits=rows, validate_args=False),
            infer=site_infer,
        )
    phi = numpyro.sample(
        name,
        numpyro.distributions.Categorical(logits=log_prior, validate_args=False),
        infer=site_infer,
    )
    if score_table is not None:
        numpyro.factor(name + SCORE_SUFFIX, gather(score_table, phi))
    return phi
