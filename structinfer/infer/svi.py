r"""Learning W_Q, W_K, W_V and hyperparameters with NumPyro's SVI, edges enumerated.

The edge sites stay discrete and are summed out exactly by ``TraceEnum_ELBO``
(funsor); the guide only covers the continuous sites. With the edges collapsed,

.. math::

    \mathcal L(\theta, \lambda) = \mathbb E_{q_\lambda(w)}\Big[\log \sum_\phi p_\theta(y, \phi, w \mid x)
        - \log q_\lambda(w)\Big],

so with only ``numpyro.param`` sites (or an :class:`~numpyro.infer.autoguide.AutoDelta`
guide) SVI is maximum (a posteriori) likelihood of the attention parameters.

Attention as a *conditional* model of outputs :math:`y` given inputs :math:`x`
needs the edge posterior given :math:`x` as the distribution of :math:`\phi`,
:math:`p(\phi_i = j \mid x) = \mathrm{softmax}_j(\log p(\phi_i=j) + s_{ij})`;
:func:`conditional_edge` declares exactly that (the edge plus a
``-\mathrm{logsumexp}`` factor), so that
:math:`p(y \mid x) = \prod_i \sum_j p(\phi_i = j \mid x)\, p(y_i \mid \phi_i = j)`.
Without the normaliser the unnormalised scores make the likelihood unbounded in
:math:`W_Q, W_K`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpyro
from numpyro.handlers import block, substitute
from numpyro.infer import SVI, TraceEnum_ELBO
from numpyro.infer.autoguide import AutoDelta, AutoNormal

from ..exact import inspect_model
from ..primitives import edge, is_enumerated
from ..priors import as_prior
from ..scores import as_score
from ._diagnose import bad_leaf, nonfinite_site
from ._loop import LoopInfo, check, run_loop

__all__ = ["conditional_edge", "NORMALIZER_SUFFIX", "SVIFit", "fit_svi", "hide_edges"]

#: suffix of the factor site :func:`conditional_edge` adds
NORMALIZER_SUFFIX = ".normalizer"


def conditional_edge(name: str, prior, score, **kwargs) -> jax.Array:
    r"""An edge whose distribution is its posterior given the scores (attention as a
    conditional model):

    .. math::

        \log p(\phi_i = j \mid x) = \log p(\phi_i = j) + s_{ij}
            - \log \sum_{j'} p(\phi_i = j') e^{s_{ij'}}.

    It is :func:`structinfer.edge` plus a factor site ``name + ".normalizer"`` holding
    :math:`-\mathrm{logsumexp}_j(\log p + s)`, which does not depend on the edge, so
    the exact engine and ``TraceEnum_ELBO`` see a normalised edge. Use it when the
    edge feeds an observed site (``y ~ N(v_\phi, σ)``) and :math:`W_Q, W_K` are learned.

    Args:
        name, prior, score: as in :func:`structinfer.edge` (``score`` required).
        **kwargs: passed to :func:`structinfer.edge`.

    Reference: the edge posterior as attention, Singh & Buckley sec. 3.1 eq. 1: ``p(phi_i = j | x) = softmax_j(psi_ij + log p_ij)``.
    """
    if score is None:
        raise ValueError(f"conditional_edge('{name}'): a score is required")
    phi = edge(name, prior, score, **kwargs)
    p = as_prior(prior, name)
    s = as_score(score, name).dense()
    n = s.shape[-2]
    numpyro.factor(name + NORMALIZER_SUFFIX, -jax.nn.logsumexp(p.log_table(n) + s, axis=-1))
    return phi


def hide_edges(model: Callable) -> Callable:
    """``model`` with its enumerated (edge) sites hidden, for building an autoguide of the
    continuous sites only (``AutoNormal(hide_edges(model))``)."""
    return block(model, hide_fn=is_enumerated)


class SVIFit(NamedTuple):
    """Result of :func:`fit_svi`: learned ``params``, the ``guide``, the ``svi`` object
    and its final ``state`` (continue with ``svi.update``)."""

    params: dict
    guide: Any
    svi: SVI
    state: Any


def fit_svi(
    model: Callable,
    *args,
    guide: Callable | str | None = "delta",
    optim=None,
    learning_rate: float = 0.01,
    num_steps: int = 1000,
    tol: float = 1e-7,
    rng_key: jax.Array | None = None,
    max_plate_nesting: int | None = None,
    raise_on_nonfinite: bool = True,
    **kwargs,
) -> tuple[SVIFit, LoopInfo]:
    r"""Fit a model with edge sites by SVI with the edges enumerated (``TraceEnum_ELBO``).

    Args:
        model: a NumPyro model using :func:`structinfer.edge` /
            :func:`conditional_edge`; parameters as ``numpyro.param`` or sample sites.
        *args, **kwargs: the model's arguments (data).
        guide: ``"delta"`` (MAP, :class:`~numpyro.infer.autoguide.AutoDelta`),
            ``"normal"`` (:class:`~numpyro.infer.autoguide.AutoNormal`), a guide
            callable (it must not sample the edge sites), or ``None`` when the model
            has only ``numpyro.param`` sites. Autoguides are built on
            :func:`hide_edges` ``(model)``.
        optim: a ``numpyro.optim`` optimiser (default ``Adam(learning_rate)``).
        num_steps: the most SVI steps.
        tol: converged when the exponential moving average of the loss (decay 0.9)
            changes by at most ``tol * max(1, |loss|)``.
        rng_key: PRNG key (default ``PRNGKey(0)``).
        max_plate_nesting: for ``TraceEnum_ELBO`` (default: found from the model).
        raise_on_nonfinite: raise :class:`~structinfer.infer.NonFiniteEnergyError`
            naming the step and the parameter / site when the loss becomes non-finite.

    Returns:
        ``(SVIFit, LoopInfo)``; ``info.energy[t]`` is the loss (negative ELBO, the
        free energy) at the parameters after ``t`` updates (one extra forward pass
        per step buys this exact record).

    Reference: NumPyro ``SVI`` with ``TraceEnum_ELBO`` (edges summed out exactly); learning ``W_Q, W_K, W_V`` of Singh & Buckley Table 1 by maximising the collapsed evidence.
    """
    if not callable(model):
        raise TypeError(f"fit_svi: model must be callable, got {type(model).__name__}")
    if isinstance(guide, str):
        if guide not in ("delta", "normal"):
            raise ValueError(f"fit_svi: guide must be 'delta', 'normal', a callable or None, got {guide!r}")
        if inspect_model(model, *args, **kwargs).latent:
            guide = (AutoDelta if guide == "delta" else AutoNormal)(hide_edges(model))
        else:
            guide = None
    if guide is None:
        def guide(*a, **k):
            return None
    optim = optim if optim is not None else numpyro.optim.Adam(learning_rate)
    elbo = TraceEnum_ELBO() if max_plate_nesting is None else TraceEnum_ELBO(
        max_plate_nesting=max_plate_nesting)
    svi = SVI(model, guide, optim, elbo)
    key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    state = svi.init(key, *args, **kwargs)

    def step(carry):
        st, ema = carry
        new, _ = svi.update(st, *args, **kwargs)
        loss = svi.evaluate(new, *args, **kwargs)
        ema_new = 0.9 * ema + 0.1 * loss
        conv = jnp.abs(ema_new - ema) <= tol * jnp.maximum(1.0, jnp.abs(ema_new))
        return (new, ema_new), loss, conv

    @jax.jit
    def run(state):
        loss0 = svi.evaluate(state, *args, **kwargs)
        return run_loop(step, (state, loss0), loss0, num_steps)

    (state, _), info = run(state)
    if raise_on_nonfinite:
        def site(_):
            bad_state, _ = svi.update(state, *args, **kwargs)  # the failing update, eagerly
            params = svi.get_params(bad_state)
            bad = bad_leaf(params)
            if bad:
                return f"parameter {bad}"
            values = dict(params)
            if hasattr(guide, "median"):
                values.update(guide.median(params))
            return nonfinite_site(substitute(model, data=values), *args, **kwargs)

        check(info, "fit_svi", site)
    return SVIFit(svi.get_params(state), guide, svi, state), info
