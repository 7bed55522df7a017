r"""Bayesian model expansion (Tschantz, slides "Bayesian model expansion"): add a parent
when a child is not explained by the current ones.

For the children in order, with the active parents $\{z_k\}$,

$$E_n = -\log \sum_{k\ \mathrm{active}} \exp \mathrm{sim}(x_n, z_k);
\qquad E_n > \tau \;\Rightarrow\; z_{K+1} \leftarrow \mathrm{init}(x_n).$$

The step is `structinfer.mechanisms.expansion.add_component` (also behind the
catalogue's `expand_components`); `expand` scans it over the children with any
similarity. Not a fixed-point iteration: one pass, no convergence rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..mechanisms.expansion import add_component, check_tau, nan_factor

__all__ = ["ExpansionResult", "expand"]


class ExpansionResult(NamedTuple):
    r"""What `structinfer.infer.expand` returns.

    Attributes:
        parents: `(K_max, ...)` parent states (new ones initialised from children).
        active: `(K_max,)` bool, the parents in the model.
        energies: `(children,)` $E_n = -\log\sum_{k\ \mathrm{active}} e^{\mathrm{sim}(x_n, z_k)}$
            of each child when it arrived (before any parent it caused was added).
        added: `(children,)` bool, children that became a new parent.
        overflow: True if some child exceeded $\tau$ with no free slot left.
    """

    parents: Any
    active: jax.Array
    energies: jax.Array
    added: jax.Array
    overflow: jax.Array


def expand(
    children: jax.Array,
    parents: Any,
    active: jax.Array,
    sim_fn: Callable[[jax.Array, Any], jax.Array],
    tau: float,
    init_fn: Callable[[jax.Array], Any] | None = None,
) -> ExpansionResult:
    r"""Bayesian model expansion (Tschantz): add a parent when a child is not explained.

    $$E_n = -\log \sum_{k\ \mathrm{active}} \exp \mathrm{sim}(x_n, z_k);
    \qquad E_n > \tau \;\Rightarrow\; z_{K+1} \leftarrow \mathrm{init}(x_n).$$

    Pure `jax.lax.scan` over the children with a fixed capacity `K_max` (the parents'
    leading dim); inactive slots are masked out of the log-sum-exp.

    Args:
        children: `(N, ...)`.
        parents: pytree of `(K_max, ...)` arrays (inactive rows are placeholders).
        active: `(K_max,)` bool.
        sim_fn: `(child, parents) -> (K_max,)` similarities (log-potentials).
        tau: energy threshold.
        init_fn: child -> a parent row (pytree like one row of `parents`); default identity.

    Returns:
        `ExpansionResult`.

    Raises:
        ValueError: `active` is not one-dimensional, or `sim_fn` returns another shape
            than `active`'s, or `tau` is not a scalar (shapes are static: under `jit`
            too); a NaN `tau` (traced:
            the energies, the parents and their gradients are NaN).
        TypeError: `tau` is not a number.
    """
    active = jnp.asarray(active, bool)
    init = init_fn or (lambda c: c)
    if active.ndim != 1:
        raise ValueError(f"expand: active must be (K_max,), got shape {active.shape}")
    tau = check_tau(tau, "expand")
    poison = nan_factor(tau)  # a traced NaN tau: NaN energies, parents, gradients

    def body(carry, child):
        par, act, overflow = carry
        sim = sim_fn(child, par)
        if jnp.shape(sim) != act.shape:
            raise ValueError(
                f"expand: sim_fn must return one similarity per parent, shape {act.shape} "
                f"(that of `active`), got shape {tuple(jnp.shape(sim))}"
            )
        sim = jnp.where(act, sim, -jnp.inf)
        e = -jax.nn.logsumexp(sim)
        e = e * poison
        want = e > tau
        par, act, add = add_component(par, act, init(child), want)
        return (par, act, overflow | (want & ~add)), (e, add)

    (par, act, overflow), (energies, added) = jax.lax.scan(
        body, (parents, active, jnp.asarray(False)), children)
    par = jax.tree.map(lambda p: p * poison if jnp.issubdtype(p.dtype, jnp.floating) else p,
                       par)
    return ExpansionResult(par, act, energies, added, overflow)
