r"""Building blocks of the test oracles: plain `jax.numpy` softmaxes and log-sum-exps.

The reference formulas of the registry's rows (`structinfer.testing.registry`, one
beside each row) are written with these helpers, explicit softmaxes and the similarity
derivatives of Tschantz appendix B (Singh & Buckley eq. 8 for fixed points). They are
test oracles, not models: nothing here imports `structinfer`, so a bug in the engine
cannot hide in its own reference (`tests/test_mechanisms.py` checks this module's
imports and every reference's globals).

Where a paper prints a sign or an index that contradicts its own definitions, a
reference follows the definitions and the mechanism's docstring says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from jax.typing import ArrayLike

__all__ = [
    "NEG_INF",
    "softmax",
    "lse",
    "uniform_log_prior",
    "bilinear_term",
    "project_values",
    "attention_out_energy",
    "self_mask",
    "masked_attention",
    "relative_log_prior",
    "transition_terms",
    "memory_blocks",
    "chain_posterior",
]

NEG_INF = -jnp.inf
"""The log of a forbidden parent's probability."""


def softmax(logits: ArrayLike, mask: ArrayLike | None = None) -> jax.Array:
    r"""Softmax over the last axis, $e^{\ell_j} / \sum_{j'} e^{\ell_{j'}}$.

    Args:
        logits: log-weights $\ell$, any shape.
        mask: optional booleans; False entries get probability 0.

    Returns:
        The probabilities, shaped like ``logits``.
    """
    if mask is not None:
        logits = jnp.where(mask, logits, NEG_INF)
    m = jnp.max(logits, -1, keepdims=True)
    e = jnp.exp(logits - m)
    return e / jnp.sum(e, -1, keepdims=True)


def lse(logits: ArrayLike, mask: ArrayLike | None = None) -> jax.Array:
    r"""Log-sum-exp over the last axis, $\log \sum_j e^{\ell_j}$.

    Args:
        logits: log-weights $\ell$, any shape.
        mask: optional booleans; False entries are left out.

    Returns:
        The log-sum-exp, without the last axis.
    """
    if mask is not None:
        logits = jnp.where(mask, logits, NEG_INF)
    return logsumexp(logits, axis=-1)


def uniform_log_prior(mask: ArrayLike) -> jax.Array:
    r"""$-\log |\{j : M_{ij}\}|$ per child: the energy constant of a uniform prior.

    Args:
        mask: allowed ``(child, parent)`` pairs $M$.

    Returns:
        The log-prior of each child's allowed parents, ``(children,)``.
    """
    return -jnp.log(jnp.sum(jnp.asarray(mask), -1).astype(jnp.result_type(float)))


def bilinear_term(
    children: ArrayLike,
    parents: ArrayLike,
    wc: ArrayLike,
    wp: ArrayLike,
    mask: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    r"""One log-sum-exp term with $\mathrm{sim}(c, p) = (W_c v_c)^\top (W_p v_p)$.

    The gradients are (Tschantz v2 eq. 4)
    $\mathrm{child}_c = \sum_p a_{cp} W_c^\top W_p v_p$ and
    $\mathrm{parent}_p = \sum_c a_{cp} W_p^\top W_c v_c$. Leading batch dims of
    `children` / `parents` broadcast.

    Args:
        children: child nodes $v_c$, ``(..., C, d)``.
        parents: parent nodes $v_p$, ``(..., P, d)``.
        wc: the child projection $W_c$, ``(k, d)``.
        wp: the parent projection $W_p$, ``(k, d)``.
        mask: optional allowed ``(child, parent)`` pairs.

    Returns:
        ``(attention, child_grad, parent_grad, lse)``: $a_{cp}$, the child and parent
            parts of $-\partial E$, and the log-sum-exp per child.
    """
    qc = children @ wc.T
    kp = parents @ wp.T
    s = jnp.einsum("...cd,...pd->...cp", qc, kp)
    a = softmax(s, mask)
    child = jnp.einsum("...cp,...pd->...cd", a, kp) @ wc
    parent = jnp.einsum("...cp,...cd->...pd", a, qc) @ wp
    return a, child, parent, lse(s, mask)


def project_values(x: ArrayLike, wv: ArrayLike | None) -> jax.Array:
    """The value of each parent: $W_V x_j$, i.e. `x @ wv.T`, or `x` itself when `wv` is None.

    Args:
        x: parent nodes ``(m, d)``.
        wv: the value projection ``(d_v, d)`` or None.

    Returns:
        The values, ``(m, d_v)``.
    """
    return x if wv is None else x @ wv.T


def attention_out_energy(
    s: ArrayLike, log_prior: ArrayLike, values: ArrayLike, site: str = "phi", out: str = "out"
) -> dict[str, jax.Array]:
    r"""Attention, its output and the energy, keyed like the registry's quantities.

    The attention is $a_{ij} = \mathrm{softmax}_j(s_{ij} + \log p_{ij})$, the output
    $a V$ and the energy $-\sum_i \mathrm{lse}_j(s_{ij} + \log p_{ij})$.

    Args:
        s: scores ``(n, m)``.
        log_prior: log-prior ``(n, m)`` (or broadcastable).
        values: values ``(m, d_v)``.
        site: the edge site's name in the keys.
        out: the output site's name in the keys.

    Returns:
        ``{"attention:<site>": a, "output:<out>": a @ values, "energy": E}``.
    """
    logits = s + log_prior
    a = softmax(logits)
    return {
        f"attention:{site}": a,
        f"output:{out}": a @ values,
        "energy": -jnp.sum(lse(logits)),
    }


def self_mask(n: int, include_self: bool = True, causal: bool = False) -> np.ndarray:
    r"""The allowed `(child, parent)` pairs of self attention over `n` tokens.

    Args:
        n: the number of tokens.
        include_self: allow $j = i$.
        causal: only $j \le i$.

    Returns:
        A boolean ``(n, n)`` mask.
    """
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = np.ones((n, n), bool)
    if causal:
        mask &= j <= i
    if not include_self:
        mask &= j != i
    return mask


def masked_attention(s: ArrayLike, mask: ArrayLike, values: ArrayLike) -> dict[str, jax.Array]:
    """`attention_out_energy` with a uniform prior over the allowed parents of `mask`.

    Args:
        s: scores ``(n, m)``.
        mask: allowed ``(child, parent)`` pairs ``(n, m)``.
        values: values ``(m, d_v)``.

    Returns:
        The keyed attention, output and energy.
    """
    mask = jnp.asarray(mask)
    log_prior = jnp.where(mask, uniform_log_prior(mask)[:, None], NEG_INF)
    return attention_out_energy(s, log_prior, values)


def relative_log_prior(theta: ArrayLike, n: int, parameterisation: str) -> jax.Array:
    r"""$\ln P_{ij}$ for each parameterisation of Singh & Buckley appendix 8.2 (unnormalised).

    Args:
        theta: the prior's parameters.
        n: the number of nodes.
        parameterisation: ``"categorical"``, ``"relative"``, ``"circulant"`` or
            ``"hartley"``.

    Returns:
        The unnormalised log-prior ``(n, n)``.
    """
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    if parameterisation == "categorical":
        return theta
    if parameterisation == "relative":
        return theta[i - j + n - 1]
    if parameterisation == "circulant":
        return theta[(i - j) % n]
    angle = 2 * np.pi * (i - j) / n
    return sum(theta[k] * (jnp.cos(k * angle) + jnp.sin(k * angle)) for k in range(theta.shape[0]))


def transition_terms(
    x: ArrayLike,
    A: ArrayLike,
    b: ArrayLike,
    precisions: ArrayLike,
    extra: ArrayLike = 0.0,
) -> tuple[jax.Array, jax.Array]:
    r"""Residuals and similarities of a switching linear transition.

    $r_{tk} = x_{t+1} - A_k x_t - b_k$ and
    $\mathrm{sim}_{tk} = -\frac12 r_{tk}^\top \mathrm{diag}(\lambda_k) r_{tk} + \mathrm{extra}$.

    Args:
        x: the time series ``(T, d)``.
        A: mode dynamics ``(K, d, d)``.
        b: mode offsets ``(K, d)``.
        precisions: diagonal precisions $\lambda_k$, ``(K, d)``.
        extra: added to every similarity.

    Returns:
        ``(r, sim)`` of shapes ``(T-1, K, d)`` and ``(T-1, K)``.
    """
    x_prev, x_next = x[:-1], x[1:]
    r = x_next[:, None, :] - jnp.einsum("kde,te->tkd", A, x_prev) - b  # (T-1, K, d)
    sim = -0.5 * jnp.sum(r * r * precisions, -1) + extra
    return r, sim


def memory_blocks(memories: jax.Array) -> jax.Array:
    """Memories as `(blocks, memories, block size)`: a 2-d array is one block.

    Args:
        memories: ``(L, d)`` or ``(B, L, d / B)``.

    Returns:
        ``(B, L, d / B)`` memories.
    """
    return memories[None] if memories.ndim == 2 else memories


def chain_posterior(
    log_initial: ArrayLike, log_transition: ArrayLike, log_emission: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    r"""Forward-backward on a hidden Markov chain, written step by step (a Python loop).

    $\alpha_1 = \pi + e_1$, $\alpha_t(k) = e_t(k) + \log\sum_j e^{\alpha_{t-1}(j) + L_{jk}}$,
    $\beta_T = 0$, $\beta_t(j) = \log\sum_k e^{L_{jk} + e_{t+1}(k) + \beta_{t+1}(k)}$;
    $\log Z = \log\sum_k e^{\alpha_T(k)}$ and $p(z_t = k) = e^{\alpha_t(k) + \beta_t(k) - \log Z}$.

    Args:
        log_initial: normalised $\log p(z_1)$, ``(K,)``.
        log_transition: normalised $\log p(z_t \mid z_{t-1})$, ``(K, K)`` (rows: previous).
        log_emission: $e_t(k)$, ``(T, K)``.

    Returns:
        ``(log Z, marginals (T, K))``.
    """
    t_len = log_emission.shape[0]
    alpha = [log_initial + log_emission[0]]
    for t in range(1, t_len):
        alpha.append(log_emission[t] + lse(alpha[-1][None, :] + log_transition.T))
    beta = [jnp.zeros_like(alpha[0])]
    for t in range(t_len - 2, -1, -1):
        beta.insert(0, lse(log_transition + (log_emission[t + 1] + beta[0])[None, :]))
    log_z = lse(alpha[-1])
    post = jnp.exp(jnp.stack(alpha) + jnp.stack(beta) - log_z)
    return log_z, post
