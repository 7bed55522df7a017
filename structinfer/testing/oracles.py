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

import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

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
]

#: log of a forbidden parent's probability
NEG_INF = -jnp.inf


def softmax(logits, mask=None):
    """Softmax over the last axis; `mask` False entries get probability 0."""
    if mask is not None:
        logits = jnp.where(mask, logits, NEG_INF)
    m = jnp.max(logits, -1, keepdims=True)
    e = jnp.exp(logits - m)
    return e / jnp.sum(e, -1, keepdims=True)


def lse(logits, mask=None):
    """Log-sum-exp over the last axis, with optional mask."""
    if mask is not None:
        logits = jnp.where(mask, logits, NEG_INF)
    return logsumexp(logits, axis=-1)


def uniform_log_prior(mask):
    """`-log(number of allowed parents)` per child: the energy constant of a uniform prior."""
    return -jnp.log(jnp.sum(jnp.asarray(mask), -1).astype(jnp.result_type(float)))


def bilinear_term(children, parents, wc, wp, mask=None):
    r"""One log-sum-exp term with $\mathrm{sim}(c, p) = (W_c v_c)^\top (W_p v_p)$.

    Returns `(attention, child_grad, parent_grad, lse)` where (Tschantz v2 eq. 4)
    $\mathrm{child}_c = \sum_p a_{cp} W_c^\top W_p v_p$ and
    $\mathrm{parent}_p = \sum_c a_{cp} W_p^\top W_c v_c$. Leading batch dims of
    `children` / `parents` broadcast.
    """
    qc = children @ wc.T
    kp = parents @ wp.T
    s = jnp.einsum("...cd,...pd->...cp", qc, kp)
    a = softmax(s, mask)
    child = jnp.einsum("...cp,...pd->...cd", a, kp) @ wc
    parent = jnp.einsum("...cp,...cd->...pd", a, qc) @ wp
    return a, child, parent, lse(s, mask)


def project_values(x, wv):
    """The value of each parent: `x @ wv.T`, or `x` itself when `wv` is None."""
    return x if wv is None else x @ wv.T


def attention_out_energy(s, log_prior, values, site="phi", out="out"):
    """Attention `softmax(s + log_prior)`, its output `attention @ values` and the energy
    `-sum_i lse_j(s + log_prior)`, keyed like the registry's quantities."""
    logits = s + log_prior
    a = softmax(logits)
    return {
        f"attention:{site}": a,
        f"output:{out}": a @ values,
        "energy": -jnp.sum(lse(logits)),
    }


def self_mask(n, include_self=True, causal=False):
    """The allowed `(child, parent)` pairs of self attention over `n` tokens."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = np.ones((n, n), bool)
    if causal:
        mask &= j <= i
    if not include_self:
        mask &= j != i
    return mask


def masked_attention(s, mask, values):
    """`attention_out_energy` with a uniform prior over the allowed parents of `mask`."""
    mask = jnp.asarray(mask)
    log_prior = jnp.where(mask, uniform_log_prior(mask)[:, None], NEG_INF)
    return attention_out_energy(s, log_prior, values)


def relative_log_prior(theta, n, parameterisation):
    r"""$\ln P_{ij}$ for each parameterisation of Singh & Buckley appendix 8.2 (unnormalised)."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    if parameterisation == "categorical":
        return theta
    if parameterisation == "relative":
        return theta[i - j + n - 1]
    if parameterisation == "circulant":
        return theta[(i - j) % n]
    angle = 2 * np.pi * (i - j) / n
    return sum(theta[k] * (jnp.cos(k * angle) + jnp.sin(k * angle)) for k in range(theta.shape[0]))


def transition_terms(x, A, b, precisions, extra=0.0):
    r"""Residuals $r_{tk} = x_{t+1} - A_k x_t - b_k$ and similarities
    $-\frac12 r^\top \mathrm{diag}(\lambda_k) r + \mathrm{extra}$ of a switching linear
    transition."""
    x_prev, x_next = x[:-1], x[1:]
    r = x_next[:, None, :] - jnp.einsum("kde,te->tkd", A, x_prev) - b  # (T-1, K, d)
    sim = -0.5 * jnp.sum(r * r * precisions, -1) + extra
    return r, sim


def memory_blocks(memories):
    """Memories as `(blocks, memories, block size)`: a 2-d array is one block."""
    return memories[None] if memories.ndim == 2 else memories
