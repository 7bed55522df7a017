r"""Independent reference implementations of the papers' closed forms.

Each function implements, with plain ``jax.numpy`` and explicit softmaxes, the formula a
paper states for a mechanism: the attention (a softmax), the output (its expectation),
the energy (a sum of log-sum-exps) and the gradients (softmax-weighted sums of the
similarity derivatives, Tschantz appendix B; Singh & Buckley eq. 8 for fixed points).
Nothing here calls the structinfer engine: these are the oracles the contract test
(``tests/test_mechanisms.py``) compares the engine against. Each returns a dict keyed
like the registry's quantities (``"attention:phi"``, ``"output:out"``, ``"energy"``,
``"-grad:x"``, ``"fixed_point:slots"`` ...).

Where a paper prints a sign or an index that contradicts its own definitions, the
reference follows the definitions and the mechanism's docstring says so.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from jax.scipy.stats import beta as beta_dist

NEG_INF = -jnp.inf


# --------------------------------------------------------------------------- helpers


def softmax(logits, mask=None):
    """Softmax over the last axis; ``mask`` False entries get probability 0."""
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
    """``-log(number of allowed parents)`` per child: the energy constant of a uniform prior."""
    return -jnp.log(jnp.sum(jnp.asarray(mask), -1).astype(jnp.result_type(float)))


def bilinear_term(children, parents, wc, wp, mask=None):
    r"""One log-sum-exp term with :math:`\mathrm{sim}(c, p) = (W_c v_c)^\top (W_p v_p)`.

    Returns ``(attention, child_grad, parent_grad, lse)`` where (Tschantz v2 eq. 4)
    ``child_grad[c] = sum_p a_cp W_c^T W_p v_p`` and ``parent_grad[p] = sum_c a_cp W_p^T W_c v_c``.
    Leading batch dims of ``children``/``parents`` broadcast.
    """
    qc = children @ wc.T
    kp = parents @ wp.T
    s = jnp.einsum("...cd,...pd->...cp", qc, kp)
    a = softmax(s, mask)
    child = jnp.einsum("...cp,...pd->...cd", a, kp) @ wc
    parent = jnp.einsum("...cp,...cd->...pd", a, qc) @ wp
    return a, child, parent, lse(s, mask)


def _values(x, wv):
    return x if wv is None else x @ wv.T


def _attention_out_energy(s, log_prior, values, site="phi", out="out"):
    logits = s + log_prior
    a = softmax(logits)
    return {
        f"attention:{site}": a,
        f"output:{out}": a @ values,
        "energy": -jnp.sum(lse(logits)),
    }


# ------------------------------------------------------------- Singh & Buckley, Table 1


def cross_attention(xq, xk, wq, wk, wv=None, scale=None):
    """Sec. 3.2: softmax_j(x'_i^T W_Q^T W_K x_j) W_V x_j; energy -sum lse + n log m."""
    s = (xq @ wq.T) @ (xk @ wk.T).T * (1.0 if scale is None else scale)
    return _attention_out_energy(s, -math.log(xk.shape[0]), _values(xk, wv))


def cross_attention_gradients(xq, xk, wq, wk, wv=None, scale=None):
    """Tschantz v2 eqs. 30-31 with the chain rule through W_Q, W_K."""
    s_ = 1.0 if scale is None else scale
    q, k = xq @ wq.T, xk @ wk.T
    a = softmax(s_ * q @ k.T)
    return {
        "energy": -jnp.sum(lse(s_ * q @ k.T)) + xq.shape[0] * math.log(xk.shape[0]),
        "-grad:xq": s_ * (a @ k) @ wq,
        "-grad:xk": s_ * (a.T @ q) @ wk,
    }


def _self_mask(n, include_self=True, causal=False):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = np.ones((n, n), bool)
    if causal:
        mask &= j <= i
    if not include_self:
        mask &= j != i
    return mask


def _masked(s, mask, values):
    mask = jnp.asarray(mask)
    log_prior = jnp.where(mask, uniform_log_prior(mask)[:, None], NEG_INF)
    return _attention_out_energy(s, log_prior, values)


def self_attention(x, wq, wk, wv=None, include_self=True, causal=False, scale=None):
    """Appendix 8.1: softmax over the allowed parents."""
    s = (x @ wq.T) @ (x @ wk.T).T * (1.0 if scale is None else scale)
    return _masked(s, _self_mask(x.shape[0], include_self, causal), _values(x, wv))


def self_attention_gradients(x, wq, wk, wv=None, include_self=True, causal=False, scale=None):
    """Tschantz v2 eq. 13: child part + parent part."""
    assert scale is None
    mask = _self_mask(x.shape[0], include_self, causal)
    _, child, parent, lv = bilinear_term(x, x, wq, wk, mask)
    return {
        "energy": -jnp.sum(lv + uniform_log_prior(mask)),
        "-grad:x": child + parent,
    }


def graph_attention(x, wq, wk, wv, adjacency, self_loops=False):
    mask = np.asarray(adjacency) != 0
    if self_loops:
        mask = mask | np.eye(mask.shape[0], dtype=bool)
    return _masked((x @ wq.T) @ (x @ wk.T).T, mask, _values(x, wv))


def sparse_attention(x, wq, wk, wv, window=None, block_mask=None, block_size=None, causal=True):
    n = x.shape[0]
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    if window is not None:
        mask = (d >= 0) & (d < window) if causal else np.abs(d) < window
    else:
        mask = np.kron(np.asarray(block_mask, bool), np.ones((block_size, block_size), bool))
    return _masked((x @ wq.T) @ (x @ wk.T).T, mask, _values(x, wv))


def relative_log_prior(theta, n, parameterisation):
    """ln P_ij for each parameterisation of appendix 8.2 (unnormalised)."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    if parameterisation == "categorical":
        return theta
    if parameterisation == "relative":
        return theta[i - j + n - 1]
    if parameterisation == "circulant":
        return theta[(i - j) % n]
    angle = 2 * np.pi * (i - j) / n
    return sum(theta[k] * (jnp.cos(k * angle) + jnp.sin(k * angle)) for k in range(theta.shape[0]))


def relative_position_attention(x, wq, wk, wv, theta, parameterisation="hartley"):
    """Appendix 8.2: softmax_j(x_i Q^T K x_j + ln p_ij)."""
    ln_p = relative_log_prior(theta, x.shape[0], parameterisation)
    log_prior = ln_p - lse(ln_p)[:, None]
    return _attention_out_energy((x @ wq.T) @ (x @ wk.T).T, log_prior, _values(x, wv))


def absolute_position_attention(x, positions, wq, wk, wv=None):
    xt = x + positions
    s = (xt @ wq.T) @ (xt @ wk.T).T
    return _attention_out_energy(s, -math.log(x.shape[0]), _values(x, wv))


def classification_layer(x, w1, b1, w2, b2, classes):
    f = jnp.tanh(x @ w1.T + b1) @ w2.T + b2
    a = softmax(f @ classes.T)
    return {
        "attention:class": a,
        "output:out": a @ classes,
        "energy": -jnp.sum(lse(f @ classes.T)) + x.shape[0] * math.log(classes.shape[0]),
    }


def hopfield(memories, state, num_states, beta=1.0, node_potential=True):
    r"""Ramsauer's update :math:`\xi^{new} = X \mathrm{softmax}(\beta X^\top \xi)` (S&B sec. 4.2),
    the energy :math:`\beta E_{\mathrm{Ramsauer}}` + constants, or (no node potential) Tschantz
    v2 eqs. 7-8."""
    s = beta * state @ memories.T
    a = softmax(s)
    n, d = memories.shape
    e = -jnp.sum(lse(s)) + num_states * math.log(n)
    if node_potential:
        e = e + 0.5 * beta * jnp.sum(state**2) + num_states * d * 0.5 * math.log(2 * math.pi / beta)
        return {"attention:phi": a, "energy": e, "fixed_point:state": a @ memories}
    return {
        "attention:phi": a,
        "energy": e,
        "-grad:state": beta * a @ memories,
        "-grad:memories": beta * a.T @ state,
    }


def slot_attention(x, wq, wk, slots, num_slots, node_potential=True):
    r"""S&B sec. 4.3 fixed point / Tschantz v2 eqs. 10-11."""
    a, grad_x, grad_slots, lv = bilinear_term(x, slots, wk, wq)  # children: tokens, parents: slots
    e = -jnp.sum(lv) + x.shape[0] * math.log(num_slots)
    out = {"attention:phi": a}
    if node_potential:
        d = x.shape[1]
        out["energy"] = e + 0.5 * jnp.sum(slots**2) + num_slots * d * 0.5 * math.log(2 * math.pi)
        out["fixed_point:slots"] = grad_slots
    else:
        out["energy"] = e
        out["-grad:slots"] = grad_slots
        out["-grad:x"] = grad_x
    return out


def _memory_blocks(memories):
    return memories[None] if memories.ndim == 2 else memories


def block_slot_attention(x, memories, wq, wk, slots, num_slots, node_potential=True):
    r"""Appendix 8.2.1: :math:`\mu_i^* = \sum_j \mathrm{softmax}_i(\cdot) W_Q^\top W_K x_j +
    \sum_{k,b}\mathrm{softmax}_k(\mu_i^{(b)}\cdot m_k^{(b)}) m_k^{(b)}`."""
    mem = _memory_blocks(memories)
    nb, nl, db = mem.shape
    a, _, token_term, l1 = bilinear_term(x, slots, wk, wq)
    blocks = slots.reshape(num_slots, nb, db)  # (S, B, db)
    s2 = jnp.einsum("sbd,bld->sbl", blocks, mem)
    h = softmax(s2)
    memory_term = jnp.einsum("sbl,bld->sbd", h, mem).reshape(num_slots, nb * db)
    e = (
        -jnp.sum(l1)
        - jnp.sum(lse(s2))
        + x.shape[0] * math.log(num_slots)
        + num_slots * nb * math.log(nl)
        + 0.5 * jnp.sum(slots**2)
        + slots.size * 0.5 * math.log(2 * math.pi)
    )
    return {
        "attention:token_slot": a,
        "attention:slot_memory": h.swapaxes(0, 1),
        "energy": e,
        "fixed_point:slots": token_term + memory_term,
    }


def block_slot_energy(x, memories, wq, wk, slots, num_slots):
    """Tschantz slides: two lse terms per token."""
    a, child_z, parent_z, l1 = bilinear_term(x, slots, wk, wq)
    sm = x @ memories.T
    h = softmax(sm)
    n = x.shape[0]
    return {
        "attention:slot": a,
        "attention:memory": h,
        "energy": -jnp.sum(l1)
        - jnp.sum(lse(sm))
        + n * math.log(num_slots)
        + n * math.log(memories.shape[0]),
        "-grad:x": child_z + h @ memories,
        "-grad:slots": parent_z,
        "-grad:memories": h.T @ x,
    }


def predictive_coding_network(y, weights, precisions, prior_mean, prior_precision, **latents):
    r"""S&B appendix 7.2: softmax over incoming prediction errors; the gradient of F per layer."""
    L = len(weights)
    mus = [latents[f"z{lv}"] for lv in range(L)] + [y]
    alphas, errors = [], []
    for lv in range(L):
        w, k = weights[lv], precisions[lv]
        eps = mus[lv + 1][:, None] - w * mus[lv][None, :]  # (n_{l+1}, n_l)
        alphas.append(softmax(-0.5 * k[:, None] * eps**2))
        errors.append(eps)
    out = {f"attention:phi{lv + 1}": alphas[lv] for lv in range(L)}
    for lv in range(L):  # latent layers
        grad_f = jnp.zeros_like(mus[lv])
        if lv == 0:
            grad_f = grad_f + prior_precision * (mus[0] - prior_mean)
        else:  # incoming edges of layer l (its units are children of layer l-1)
            a, eps, k = alphas[lv - 1], errors[lv - 1], precisions[lv - 1]
            grad_f = grad_f + jnp.sum(a * k[:, None] * eps, -1)
        a, eps, k, w = alphas[lv], errors[lv], precisions[lv], weights[lv]  # outgoing edges
        grad_f = grad_f - jnp.sum(a * k[:, None] * eps * w, 0)
        out[f"-grad:z{lv}"] = -grad_f
    return out


def multihop_attention(x, wq, wk, wv=None, hops=2):
    r"""Appendix 7.3 / Algorithm 2: :math:`(\sum_{k=1}^{N} P^k) V X`."""
    p = softmax((x @ wq.T) @ (x @ wk.T).T)
    v = _values(x, wv)
    out, acc, pk = {"attention:hop1": p}, jnp.zeros_like(v), jnp.eye(x.shape[0], dtype=x.dtype)
    for h in range(1, hops + 1):
        pk = pk @ p
        acc = acc + pk @ v
        out[f"output:out{h}"] = acc
    out["output:out"] = acc
    return out


def expanding_attention(x, wq, wk, wv, q, alpha, beta):
    r"""Sec. 5.2 step 2, :math:`p(\phi \mid x, q)` with the truncated geometric prior; step 3's
    :math:`\mathbb E[d]`; and the exact :math:`\log p(x, q)`."""
    n = x.shape[0]
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    logw = jnp.where(d >= 0, jnp.log(q) + d * jnp.log1p(-q), NEG_INF)
    log_prior = logw - lse(logw)[:, None]
    s = (x @ wq.T) @ (x @ wk.T).T
    a = softmax(s + log_prior)
    return {
        "attention:phi": a,
        "output:out": a @ _values(x, wv),
        "output:distance": jnp.sum(a * d, -1),
        "energy": -(beta_dist.logpdf(q, alpha, beta) + jnp.sum(lse(s + log_prior))),
    }


# ---------------------------------------------------------------- Tschantz catalogue


def gaussian_mixture(x, means, precisions, log_weights, normalize=False):
    r"""v2 sec. 2: sim = ln pi_k - 1/2 Mahalanobis; -dE/dmu_k = sum_i alpha_ik Sigma_k^{-1}(x_i - mu_k)."""
    assert not normalize
    diff = x[:, None, :] - means[None, :, :]  # (N, K, d)
    maha = jnp.einsum("nkd,kde,nke->nk", diff, precisions, diff)
    sim = (log_weights - lse(log_weights)) - 0.5 * maha
    a = softmax(sim)
    return {
        "attention:component": a,
        "energy": -jnp.sum(lse(sim)),
        # Sigma_k^{-1} (x_i - mu_k) with the symmetric part of the given precision (the
        # Mahalanobis form only sees it; equal to the precision when it is symmetric)
        "-grad:means": jnp.einsum(
            "nk,kde,nke->kd", a, 0.5 * (precisions + precisions.swapaxes(-1, -2)), diff
        ),
    }


def nonlinear_mixture(x, mu, a, b):
    r"""v2 sec. 8 with :math:`f(\mu) = \tanh(A\mu + b)`, :math:`J_f^\top r = A^\top((1-f^2) \odot r)`."""
    f = jnp.tanh(mu @ a.T + b)  # (K, dx)
    r = x[:, None, :] - f[None]  # (N, K, dx)
    sim = -0.5 * jnp.sum(r * r, -1)
    al = softmax(sim)
    jt_r = jnp.einsum("nkx,kx,xm->nkm", r, 1 - f**2, a)
    return {
        "attention:cause": al,
        "energy": -jnp.sum(lse(sim)) + x.shape[0] * math.log(mu.shape[0]),
        "-grad:mu": jnp.einsum("nk,nkm->km", al, jt_r),
        "-grad:x": -jnp.einsum("nk,nkx->nx", al, r),
    }


def linear_mixture(x, z, A, b, precisions):
    pred = jnp.einsum("kxz,kz->kx", A, z) + b
    r = x[:, None, :] - pred[None]  # (N, K, dx)
    sim = -0.5 * jnp.sum(r * r * precisions, -1)
    al = softmax(sim)
    lr = r * precisions  # Sigma_k^{-1} r
    return {
        "attention:mode": al,
        "energy": -jnp.sum(lse(sim)) + x.shape[0] * math.log(z.shape[0]),
        "-grad:x": -jnp.einsum("nk,nkx->nx", al, lr),
        "-grad:z": jnp.einsum("nk,kxz,nkx->kz", al, A, lr),
        "-grad:A": jnp.einsum("nk,nkx,kz->kxz", al, lr, z),
        "-grad:b": jnp.einsum("nk,nkx->kx", al, lr),
    }


def _transition_terms(x, A, b, precisions, extra=0.0):
    x_prev, x_next = x[:-1], x[1:]
    r = x_next[:, None, :] - jnp.einsum("kde,te->tkd", A, x_prev) - b  # (T-1, K, d)
    sim = -0.5 * jnp.sum(r * r * precisions, -1) + extra
    return r, sim


def switching_linear_dynamics(x, A, b, precisions, log_weights):
    r"""v2 sec. 10 (state gradients with the signs of the definitions)."""
    r, sim = _transition_terms(x, A, b, precisions, log_weights - lse(log_weights))
    al = softmax(sim)
    lr = r * precisions
    grad_x = jnp.zeros_like(x)
    grad_x = grad_x.at[1:].add(-jnp.einsum("tk,tkd->td", al, lr))  # x_{t+1} as child
    grad_x = grad_x.at[:-1].add(jnp.einsum("tk,kde,tkd->te", al, A, lr))  # x_t through A_k x_t
    return {
        "attention:mode": al,
        "energy": -jnp.sum(lse(sim)),
        "-grad:A": jnp.einsum("tk,tkd,te->kde", al, lr, x[:-1]),
        "-grad:b": jnp.einsum("tk,tkd->kd", al, lr),
        "-grad:x": grad_x,
    }


def dynamic_mixture_attention(x, z, wq, wk, A, b):
    r"""v2 sec. 7 (eq. 27)."""
    ones = jnp.ones(x.shape[1], x.dtype)
    sim_p = (x[:-1] @ wq.T) @ (z @ wk.T).T  # (T-1, K)
    r, sim_d = _transition_terms(x, A, b, ones)
    sim = sim_p + sim_d
    al = softmax(sim)
    grad_x = jnp.zeros_like(x)
    grad_x = grad_x.at[1:].add(-jnp.einsum("tk,tkd->td", al, r))
    grad_x = grad_x.at[:-1].add(al @ (z @ wk.T) @ wq + jnp.einsum("tk,kde,tkd->te", al, A, r))
    return {
        "attention:mode": al,
        "energy": -jnp.sum(lse(sim)) + (x.shape[0] - 1) * math.log(A.shape[0]),
        "-grad:A": jnp.einsum("tk,tkd,te->kde", al, r, x[:-1]),
        "-grad:b": jnp.einsum("tk,tkd->kd", al, r),
        "-grad:z": (al.T @ (x[:-1] @ wq.T)) @ wk,
        "-grad:x": grad_x,
    }


def atari_model(x, A, b, obs_precisions, dyn_precisions, z):
    r"""Slides "Atari Model": child terms of z_t (GMM and dynamics) plus its parent term."""
    T = x.shape[0]
    K = A.shape[0]
    diff = x - z
    sim_o = -0.5 * jnp.einsum("td,kd->tk", diff * diff, obs_precisions)
    al = softmax(sim_o)
    r, sim_d = _transition_terms(z, A, b, dyn_precisions)
    be = softmax(sim_d)
    lr = r * dyn_precisions
    grad_z = jnp.einsum("tk,kd,td->td", al, obs_precisions, diff)
    grad_z = grad_z.at[1:].add(-jnp.einsum("tk,tkd->td", be, lr))
    grad_z = grad_z.at[:-1].add(jnp.einsum("tk,kde,tkd->te", be, A, lr))
    return {
        "attention:obs_mode": al,
        "attention:dyn_mode": be,
        "energy": -jnp.sum(lse(sim_o)) - jnp.sum(lse(sim_d)) + (2 * T - 1) * math.log(K),
        "-grad:z": grad_z,
    }


def layer_norm_energy(x, gamma, delta, eps=1e-5):
    """v2 sec. 11: the LayerNorm output gamma (x - mean) / sqrt(var + eps) + delta."""
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    D = x.shape[-1]
    return {
        "energy": jnp.sum(D * gamma * jnp.sqrt(var[:, 0] + eps)) + jnp.sum(x * delta),
        "grad:x": gamma * (x - mean) / jnp.sqrt(var + eps) + delta,
    }


def kronecker_attention(x, z, u, wz, wu):
    """Slides: joint softmax over parent pairs of sim_z + sim_u."""
    sz, su = (x @ wz.T) @ z.T, (x @ wu.T) @ u.T
    n, K, L = x.shape[0], z.shape[0], u.shape[0]
    joint = (sz[:, :, None] + su[:, None, :]).reshape(n, K * L)
    al = softmax(joint).reshape(n, K, L)
    return {
        "output:joint": al,
        "energy": -jnp.sum(lse(joint)) + n * math.log(K * L),
        "-grad:z": jnp.sum(al, 2).T @ (x @ wz.T),
        "-grad:u": jnp.sum(al, 1).T @ (x @ wu.T),
        "-grad:x": jnp.sum(al, 2) @ z @ wz + jnp.sum(al, 1) @ u @ wu,
    }


def tensor_attention(x, log_theta):
    """Slides, discrete case: alpha_ikl = theta_{x_i k l} / sum; expected counts."""
    D, K, L = log_theta.shape
    t = log_theta[x].reshape(x.shape[0], K * L)
    al = softmax(t).reshape(x.shape[0], K, L)
    counts = jnp.einsum("nd,nkl->dkl", jax.nn.one_hot(x, D, dtype=log_theta.dtype), al)
    return {
        "output:joint": al,
        "energy": -jnp.sum(lse(t)) + x.shape[0] * math.log(K * L),
        "-grad:log_theta": counts,
    }


def multi_lse(x, z, w, precision=1.0):
    diff = x[:, None, :] - z[None]
    sim = (x @ w.T) @ z.T - 0.5 * precision * jnp.sum(diff * diff, -1)
    al = softmax(sim)
    return {
        "attention:phi": al,
        "energy": -jnp.sum(lse(sim)) + x.shape[0] * math.log(z.shape[0]),
        "-grad:x": al @ z @ w - precision * jnp.einsum("nk,nkd->nd", al, diff),
        "-grad:z": al.T @ (x @ w.T) + precision * jnp.einsum("nk,nkd->kd", al, diff),
    }


def energy_transformer(x, memories, wq, wk):
    a, child, parent, l1 = bilinear_term(x, x, wq, wk)
    sm = x @ memories.T
    h = softmax(sm)
    n = x.shape[0]
    return {
        "attention:self": a,
        "attention:memory": h,
        "energy": -jnp.sum(l1)
        - jnp.sum(lse(sm))
        + n * math.log(n)
        + n * math.log(memories.shape[0]),
        "-grad:x": child + parent + h @ memories,
        "-grad:memories": h.T @ x,
    }


def spatiotemporal_hierarchy(
    x, layer_sizes, w_inter, w_intra, w_temporal, receptive_fields=None, **latents
):
    r"""v2 sec. 6 eqs. 20, 22, 24, 26 (plus the temporal parent part) / the renormalised form."""
    T = x.shape[0]
    L = len(layer_sizes) + 1
    layers = [x] + [latents[f"layer{lv}"] for lv in range(2, L + 1)]
    grads = [jnp.zeros_like(h) for h in layers]
    energy = 0.0
    for lv in range(2, L + 1):
        lower, upper = layers[lv - 2], layers[lv - 1]
        wk_, wq_ = w_inter[lv - 2]
        if receptive_fields is None:  # lower units choose upper slots
            _, child, parent, ls = bilinear_term(lower, upper, wk_, wq_)
            grads[lv - 2] += child
            grads[lv - 1] += parent
            energy += -jnp.sum(ls) + T * lower.shape[1] * math.log(upper.shape[1])
        else:  # upper units choose within their receptive field
            field = np.asarray(receptive_fields[lv - 2], bool)
            _, child, parent, ls = bilinear_term(upper, lower, wq_, wk_, field)
            grads[lv - 1] += child
            grads[lv - 2] += parent
            energy += -jnp.sum(ls + uniform_log_prior(field))
    for lv in range(1, L + 1):
        h = layers[lv - 1]
        k = h.shape[1]
        wq_, wk_ = w_intra[lv - 1]
        mask = ~np.eye(k, dtype=bool)
        _, child, parent, ls = bilinear_term(h, h, wq_, wk_, mask)  # per time step
        grads[lv - 1] += child + parent
        energy += -jnp.sum(ls) + T * k * math.log(k - 1)
        wq_, wk_ = w_temporal[lv - 1]
        ht = h.swapaxes(0, 1)  # (K, T, D)
        past = np.arange(1, T)[:, None] > np.arange(T)[None, :]
        _, child, parent, ls = bilinear_term(ht[:, 1:], ht, wq_, wk_, past)
        grads[lv - 1] += jnp.zeros_like(ht).at[:, 1:].add(child).swapaxes(0, 1)
        grads[lv - 1] += parent.swapaxes(0, 1)
        energy += -jnp.sum(ls) + k * jnp.sum(jnp.log(np.arange(1, T)))
    out = {"energy": energy}
    for lv in range(2, L + 1):
        out[f"-grad:layer{lv}"] = grads[lv - 1]
    return out


def expansion(x, x_new, components, active, tau, precision=1.0):
    """Slides: E_{N+1} = -ln sum_k p(k) exp(sim) > tau => add z_{K+1} = x_{N+1}."""

    def point_energy(v):
        sim = -0.5 * precision * jnp.sum((v - components) ** 2, -1)
        return -lse(sim, active) + jnp.log(jnp.sum(active).astype(v.dtype))

    e_new = point_energy(x_new)
    grow = (e_new > tau) & jnp.any(~active)
    idx = jnp.argmax(~active)
    new_c = jnp.where(grow, components.at[idx].set(x_new), components)
    new_a = jnp.where(grow, active.at[idx].set(True), active)
    return {
        "energy": jnp.sum(jax.vmap(point_energy)(x)),
        "expand:energy_new": e_new,
        "expand:components": new_c,
        "expand:active": new_a.astype(x.dtype),
    }


def lse_graphical_model(nodes, weights, terms):
    r"""v2 eq. 4 with sim_m(v_c, v_p) = v_c^T W_m v_p: the child part and the parent part."""
    child_part = jnp.zeros_like(nodes)
    parent_part = jnp.zeros_like(nodes)
    energy = 0.0
    for t, w in zip(terms, weights):
        c_idx, p_idx = np.asarray(t.children), np.asarray(t.parents)
        vc, vp = nodes[c_idx], nodes[p_idx]
        s = vc @ w @ vp.T
        a = softmax(s)
        child_part = child_part.at[c_idx].add(a @ vp @ w.T)  # d sim / d v_c = W v_p
        parent_part = parent_part.at[p_idx].add(a.T @ vc @ w)  # d sim / d v_p = W^T v_c
        energy = energy - jnp.sum(lse(s)) + len(c_idx) * math.log(len(p_idx))
    return {
        "energy": energy,
        "split:child": child_part,
        "split:parent": parent_part,
        "-grad:nodes": child_part + parent_part,
    }


# ----------------------------------------------------------------------------- McCarter


def idw_attention(q, keys, values, score="idw", p=2.0, eps=1e-3, sigma=1.0):
    """McCarter eqs. 1-5."""
    d2 = jnp.sum((q[:, None, :] - keys[None]) ** 2, -1)
    if score == "idw":  # eq. 5 directly: weights proportional to 1 / (eps + d^p)
        w = 1.0 / (eps + d2 ** (p / 2))
        a = w / jnp.sum(w, -1, keepdims=True)
        logits = jnp.log(w)
    else:
        logits = {
            "neg_sq": -d2,
            "gaussian": jnp.exp(-d2 / sigma**2),
            "inverse": 1.0 / (eps + d2 ** (p / 2)),
        }[score]
        a = softmax(logits)
    return {
        "attention:phi": a,
        "output:out": a @ values,
        "energy": -jnp.sum(lse(logits)) + q.shape[0] * math.log(keys.shape[0]),
    }


def idw_special_case(q, keys, values, c, p=2.0, eps=1e-3):
    r"""Sec. 2.2. The smallest :math:`\eta` written in the equivalent form
    :math:`\eta = \epsilon \max_{k\ne c}\sum_j w_j (V_{jk} - V_{jc})`, :math:`w_j = (\epsilon +
    d_j^p)^{-1}` (eq. 7 with the prefactor cancelled), and the IDW output with the added
    prototype (weight :math:`1/\epsilon`, value :math:`\eta e_c`)."""
    w = 1.0 / (eps + jnp.sum((keys - q) ** 2, -1) ** (p / 2))
    gap = w @ (values - values[:, c : c + 1])
    gap = jnp.where(jnp.arange(values.shape[1]) == c, NEG_INF, gap)
    eta = eps * jnp.max(gap)
    num = w @ values + (1.0 / eps) * eta * jax.nn.one_hot(c, values.shape[1], dtype=values.dtype)
    return {"special:eta": eta, "special:output": num / (jnp.sum(w) + 1.0 / eps)}
