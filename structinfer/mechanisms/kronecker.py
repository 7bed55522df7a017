r"""Kronecker and multi log-sum-exp energies: several parent sets or several similarities
for one child (Tschantz slides "Kronecker log-sum-exp", "Multi log-sum-exp")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
from numpyro.ops.indexing import Vindex

from .. import priors, scores
from ..primitives import edge
from ._common import check_matrix, features

__all__ = ["kronecker_attention", "tensor_attention", "multi_lse"]


def kronecker_attention(
    x: jax.Array, z: jax.Array, u: jax.Array, wz: jax.Array, wu: jax.Array
) -> None:
    r"""Kronecker log-sum-exp, continuous case: two parent sets explain each child jointly.

    Graph:
        child nodes $x_{1..N}$, parent sets $z_{1..K}$ and $u_{1..L}$; each
        child takes a pair $(k, \ell)$ through two edge sites.

    Prior:
        uniform over $z$ and over $u$, i.e. uniform over pairs.

    Potentials:
        $\mathrm{sim}(x_i; z_k, u_\ell) = \mathrm{sim}_z(x_i, z_k) + \mathrm{sim}_u(x_i, u_\ell)$
        with $\mathrm{sim}_z = (W_z x_i)^\top z_k$, $\mathrm{sim}_u = (W_u x_i)^\top u_\ell$.

    Value:
        the joint attention $\alpha_{ik\ell} = \mathrm{softmax}_{k,\ell}\,\mathrm{sim}$
        (site ``joint``: the expectation of the one-hot pair) and
        $-\partial E/\partial z_k = \sum_{i,\ell} \alpha_{ik\ell}\, W_z x_i$,
        $-\partial E/\partial x_i = \sum_{k,\ell}\alpha_{ik\ell}(W_z^\top z_k + W_u^\top u_\ell)$.

    Args:
        x: child nodes ``(N, d)``.
        z: first parent set $z_k$, ``(K, d_z)``.
        u: second parent set $u_\ell$, ``(L, d_u)``.
        wz: projection $W_z$, ``(d_z, d)``.
        wu: projection $W_u$, ``(d_u, d)``.

    Sites:
        ``phi_z``, ``phi_u`` (edges, children = x), ``joint`` (deterministic one-hot pair).

    Reference:
        Tschantz slides "Kronecker log-sum-exp".
    """
    x = features(x, "x", "kronecker_attention")
    z = features(z, "z", "kronecker_attention")
    u = features(u, "u", "kronecker_attention")
    check_matrix(wz, "wz", "kronecker_attention", x.shape[-1])
    check_matrix(wu, "wu", "kronecker_attention", x.shape[-1])
    K, L = z.shape[-2], u.shape[-2]
    with numpyro.plate("children", x.shape[-2]):
        k = edge("phi_z", priors.Uniform(K), scores.Dot(x @ wz.T, z))
        ell = edge("phi_u", priors.Uniform(L), scores.Dot(x @ wu.T, u))
        pair = jax.nn.one_hot(k * L + ell, K * L, dtype=x.dtype)
        numpyro.deterministic("joint", pair.reshape(pair.shape[:-1] + (K, L)))


def tensor_attention(x: jax.Array, log_theta: jax.Array) -> None:
    r"""Kronecker log-sum-exp, discrete case: tensor attention over two discrete parents.

    Graph:
        discrete children $x_i \in \{1..D\}$, two discrete parents
        $z \in \{1..K\}$, $u \in \{1..L\}$ per child (two edge sites).

    Prior:
        uniform over $z$ and over $u$.

    Potentials:
        $\mathrm{sim}(x_i, z_k, u_\ell) = \ln\theta_{x_i k \ell}$, a joint table over both
        parents (``numpyro.factor`` of the gathered log-table), not a sum of pairwise terms.

    Value:
        $\alpha_{ik\ell} = \theta_{x_i k\ell} / \sum_{k'\ell'} \theta_{x_i k'\ell'}$ (site
        ``joint``) and $-\partial E/\partial \ln\theta_{dk\ell} = \sum_{i: x_i = d}
        \alpha_{ik\ell}$ (the expected counts of an EM step).

    Args:
        x: integer children ``(N,)`` in ``[0, D)``.
        log_theta: ``(D, K, L)`` log of the joint categorical $\theta$.

    Sites:
        ``z``, ``u`` (edges, children = x), ``sim`` (factor), ``joint`` (deterministic).

    Reference:
        Tschantz slides "Kronecker log-sum-exp (Discrete Case)", "Tensor Attention".
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.ndim != 1:
        raise ValueError(
            f"tensor_attention: x must be a 1-d integer array of child states, got {x.dtype} {x.shape}"
        )
    log_theta = jnp.asarray(log_theta)
    if log_theta.ndim != 3:
        raise ValueError(f"tensor_attention: log_theta must be (D, K, L), got {log_theta.shape}")
    _, K, L = log_theta.shape
    with numpyro.plate("children", x.shape[0]):
        k = edge("z", priors.Uniform(K))
        ell = edge("u", priors.Uniform(L))
        numpyro.factor("sim", Vindex(log_theta)[x, k, ell])
        pair = jax.nn.one_hot(k * L + ell, K * L, dtype=log_theta.dtype)
        numpyro.deterministic("joint", pair.reshape(pair.shape[:-1] + (K, L)))


def multi_lse(x: jax.Array, z: jax.Array, w: jax.Array, precision: float = 1.0) -> None:
    r"""Multi log-sum-exp: several similarities summed inside one softmax.

    Graph:
        child nodes $x_{1..N}$, parent nodes $z_{1..K}$; one edge site per child.

    Prior:
        uniform over parents.

    Potentials:
        $\sum_m \mathrm{sim}_m(x_i, z_k)$ with $\mathrm{sim}_1 = (W x_i)^\top z_k$
        and $\mathrm{sim}_2 = -\tfrac\lambda2\|x_i - z_k\|^2$ (a ``Sum`` score).

    Value:
        $\alpha_{ik} = \mathrm{softmax}_k \sum_m \mathrm{sim}_m$,
        $-\partial E/\partial x_i = \sum_k \alpha_{ik}[W^\top z_k - \lambda(x_i - z_k)]$,
        $-\partial E/\partial z_k = \sum_i \alpha_{ik}[W x_i + \lambda(x_i - z_k)]$.

    Args:
        x: child nodes ``(N, d)``.
        z: parent nodes ``(K, d)``.
        w: the bilinear weight $W$, ``(d, d)``.
        precision: $\lambda$ of the distance term.

    Sites:
        ``phi`` (edge, children = x).

    Reference:
        Tschantz slides "Multi log-sum-exp".
    """
    x = features(x, "x", "multi_lse")
    z = features(z, "z", "multi_lse")
    check_matrix(w, "w", "multi_lse", x.shape[-1])
    score = scores.Sum(scores.Dot(x @ w.T, z), scores.NegSqDist(x, z, precision=precision))
    with numpyro.plate("children", x.shape[-2]):
        edge("phi", priors.Uniform(z.shape[-2]), score)
