r"""Slot attention with learned $W_K, W_Q$ by EM (Singh & Buckley sec. 4.3; Tschantz,
"coordinate ascent").

The model is the catalogue's `structinfer.mechanisms.slot_attention` without its node
potential: every token $x_j$ takes a slot $\phi_j$ uniformly, score
$(W_K x_j)^\top (W_Q \mu_i)$ — the softmax runs over the slots. The E-step is CCCP on
the slots (`structinfer.infer.cccp`, node potential $\tfrac12\|\mu\|^2$) and the edge
marginals of `phi` at its result; the M-step is weighted least squares for the
projections.

`init`, `step` and `run` (exported as `structinfer.infer.slot_em`) are pure functions
of a `SlotState`; `m_step` (exported as `structinfer.infer.slot_m_step`) is Tschantz's
untied least squares, `tied_m_step` the M-step `run` uses.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from numpyro.handlers import substitute

from .._checks import (
    as_float_array,
    check_count,
    check_layout,
    check_nonempty,
    check_nonnegative,
    check_tol,
    check_value,
    is_concrete,
)
from ..exact import log_marginal, marginals
from ..mechanisms.slot import slot_attention
from . import convex_concave
from ._common import check_linalg_dtype, rel_change_small, rel_change_small_tree
from ._loop import LoopInfo, check, iterate

__all__ = ["SlotState", "m_step", "tied_m_step", "init", "step", "run"]


def _default_rtol(dtype, *dims) -> float:
    """Relative eigenvalue cut-off ``10 * max(dims) * eps(dtype)`` (NumPy's ``pinv`` default)."""
    return 10.0 * max(dims) * float(jnp.finfo(dtype).eps)


def _check_rtol(rtol, what: str):
    """The eigenvalue cut-off: a number in ``[0, 1)`` (`check_value`: NaN when traced).

    ``rtol >= 1`` (or NaN) would cut every eigenvalue, the largest too, and leave
    ``W_K = 0``; a negative one would invert the zero eigenvalues.
    """
    return check_value(rtol, lambda xp, v: (v >= 0) & (v < 1), what,
                       "must be a number in [0, 1) (the eigenvalue cut-off relative to the "
                       "largest eigenvalue)")


def _poison(rtol, *arrays):
    """``arrays`` NaN where a traced ``rtol`` failed `_check_rtol` (it is NaN then):
    every cut-off compares False with NaN and would return a finite ``W = 0``."""
    if is_concrete(rtol):
        return arrays
    return tuple(a + (0 * rtol).astype(a.dtype) for a in arrays)


def _slot_rank(x, slots, wk, wq) -> int:
    """Static bound on the rank of the fitted ``W_K``, ``W_Q``: ``min(d_k, S, d_mu, d_x)``."""
    return min(wk.shape[0], slots.shape[-2], wq.shape[-1], x.shape[-1])


def _pinv_sqrt_psd(c, rank: int, rtol: float):
    r"""$C^{+1/2} = \sum_{\lambda_a > \tau} \lambda_a^{-1/2} v_a v_a^\top$ for p.s.d. $C$.

    Only the ``rank`` largest eigenvalues (a static bound from the shapes) that exceed
    $\tau = \mathrm{rtol}\cdot\lambda_{\max}$ are inverted; the rest, exact zeros
    that rounding turned into $\pm\varepsilon\lambda_{\max}$, are set to 0, so
    $C^{+1/2} C\, C^{+1/2}$ is the orthogonal projector onto the range of $C$.
    """
    evals, evecs = jnp.linalg.eigh(0.5 * (c + jnp.swapaxes(c, -1, -2)))  # ascending
    d = c.shape[-1]
    keep = (jnp.arange(d) >= d - rank) & (evals > rtol * jnp.max(evals))
    inv = jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, evals, 1.0)), 0.0)
    return (evecs * inv) @ evecs.T


def _polar(m):
    r"""Orthogonal polar factor $U V^\top$ of $m = U \Sigma V^\top$.

    The $O$ with orthonormal rows (or columns) maximising $\mathrm{tr}(O^\top m)$.
    """
    u, _, vt = jnp.linalg.svd(m, full_matrices=False)
    return u @ vt


def m_step(
    x: jax.Array,
    slots: jax.Array,
    attention: jax.Array,
    wk: jax.Array,
    wq: jax.Array,
    *,
    whiten: bool = True,
    ridge: float = 0.0,
    rtol: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Weighted least squares for $W_Q$ then $W_K$ (Tschantz, "coordinate ascent").

    $$
    \min \sum_{j,i} A_{ji} \|W_K x_j - W_Q \mu_i\|^2: \quad
    W_Q = \Big(\sum A_{ji} W_K x_j \mu_i^\top\Big)\Big(\sum A_{ji}\mu_i\mu_i^\top\Big)^{+},\quad
    W_K = \Big(\sum A_{ji} W_Q \mu_i x_j^\top\Big)\Big(\sum A_{ji} x_j x_j^\top\Big)^{+}.
    $$

    Gram matrices are pseudo-inverted (minimum-norm solutions when they are singular,
    e.g. fewer slots than slot dimensions). The objective is minimised jointly by
    $W_K = W_Q = 0$, and alternating the two solves shrinks both towards it (each
    is a regression; their product has the squared canonical correlations as
    eigenvalues). ``whiten=True`` adds the scale constraint
    $W_K C_{xx} W_K^\top = \Pi$ ($C_{xx} = \sum A x x^\top / \sum A$) after
    the $W_K$ solve, $W_K \leftarrow (W_K C_{xx} W_K^\top)^{+1/2} W_K$,
    which turns the alternation into the power iteration of weighted canonical
    correlation analysis between tokens and their slots. $\Pi$ is the orthogonal
    projector onto the range of $W_K C_{xx} W_K^\top$: $I$ when it has full
    rank, rank $\le \min(S, d_\mu, d_x)$ otherwise (e.g. more key dimensions than
    slots) — the whitening acts on that range only, so it is continuous in the data.

    This single step leaves the gauge $(\mu, W_Q) \to (c\mu, W_Q/c)$ free (it
    changes no score, but the E-step fixes $|\mu| \propto |W_Q|$);
    [`slot_em`][structinfer.infer.slot_em] uses the well-posed variant described there
    (`tied_m_step`).

    Args:
        x: ``(tokens, d_x)``.
        slots: ``(S, d_mu)``.
        attention: ``(tokens, S)``, rows sum to 1.
        wk: ``(d_k, d_x)``.
        wq: ``(d_k, d_mu)``.
        whiten: apply the scale constraint above.
        ridge: added to both Gram matrices (non-negative; under `jax.jit`, where it
            cannot be checked, a negative `ridge` gives NaN).
        rtol: eigenvalue cut-off relative to the largest eigenvalue for the
            pseudo-inverses and the whitening, in ``[0, 1)``; default
            ``10 * max(shape) * eps(dtype)`` (under `jax.jit`, where it cannot be
            checked, one outside ``[0, 1)`` gives NaN).

    Returns:
        ``(wk, wq)``, the new $W_K$ and $W_Q$.

    Raises:
        TypeError: `x` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: a negative ``ridge``, or an ``rtol`` outside ``[0, 1)``.

    Reference:
        Singh & Buckley sec. 4.3 (the score $\mu_i^\top W_Q^\top W_K x_j$); Tschantz,
        coordinate ascent for $W_K, W_Q$.
    """
    A = attention
    check_linalg_dtype(jnp.asarray(x), "slot_m_step: x")
    ridge = check_nonnegative(ridge, "slot_m_step: ridge", "added to both Gram matrices")
    rtol = (_default_rtol(x.dtype, *wk.shape, *wq.shape, *slots.shape) if rtol is None
            else _check_rtol(rtol, "slot_m_step: rtol"))
    cxx = jnp.einsum("js,ja,jb->ab", A, x, x) + ridge * jnp.eye(x.shape[-1], dtype=x.dtype)
    cmm = jnp.einsum("js,sa,sb->ab", A, slots, slots) + ridge * jnp.eye(
        slots.shape[-1], dtype=x.dtype)
    cxm = jnp.einsum("js,ja,sb->ab", A, x, slots)  # Σ A x μ^T
    # pseudo-inverses: with fewer slots than slot dims the slot Gram matrix is singular,
    # and the minimum-norm least-squares solution is the one we take
    wq_new = wk @ cxm @ jnp.linalg.pinv(cmm, rtol=rtol, hermitian=True)
    wk_new = wq_new @ cxm.T @ jnp.linalg.pinv(cxx, rtol=rtol, hermitian=True)
    if whiten:
        c = wk_new @ (cxx / jnp.sum(A)) @ wk_new.T
        wk_new = _pinv_sqrt_psd(c, _slot_rank(x, slots, wk, wq), rtol) @ wk_new
    return _poison(rtol, wk_new, wq_new)


def tied_m_step(
    x: jax.Array,
    slots: jax.Array,
    attention: jax.Array,
    wk: jax.Array,
    wq: jax.Array,
    *,
    whiten: bool,
    ridge: float,
    rtol: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""The M-step of [`slot_em`][structinfer.infer.slot_em], slots tied to the E-step's fixed point.

    Steps 1–4 of [`slot_em`][structinfer.infer.slot_em]; the slots are tied to the
    E-step's fixed point $\mu_i = W_Q^\top m_i$.

    Args:
        x: `(tokens, d_x)`.
        slots: `(S, d_mu)`.
        attention: `(tokens, S)`, rows sum to 1.
        wk: `(d_k, d_x)`.
        wq: `(d_k, d_mu)`.
        whiten: steps 2–3.
        ridge: added to $\sum A x x^\top$ and to the within-slot scatter.
        rtol: eigenvalue cut-off relative to the largest eigenvalue.

    Returns:
        `(wk, wq, slots)`: the new projections and the slots $\mu_i = W_Q^\top m_i$ the
            next E-step starts from.
    """
    A = attention
    n = jnp.sum(A, 0)  # N_i, the slots' masses
    eye = jnp.eye(x.shape[-1], dtype=x.dtype)
    # 1. W_K by weighted least squares given the queries q_i = W_Q mu_i
    q = slots @ wq.T
    cxx = jnp.einsum("js,ja,jb->ab", A, x, x) + ridge * eye
    wk_new = jnp.einsum("js,sa,jb->ab", A, q, x) @ jnp.linalg.pinv(cxx, rtol=rtol, hermitian=True)
    if whiten:
        # 2. unit within-slot key covariance, on its range (centred in difference form:
        #    no cancellation when the slots are far apart relative to their spread)
        xbar = (A.T @ x) / jnp.where(n > 0, n, 1.0)[:, None]
        diff = x[:, None, :] - xbar[None, :, :]
        cw = (jnp.einsum("js,jsa,jsb->ab", A, diff, diff) + ridge * eye) / jnp.sum(A)
        wk_new = _pinv_sqrt_psd(wk_new @ cw @ wk_new.T, _slot_rank(x, slots, wk, wq),
                                rtol) @ wk_new
        # 3. the rotation left free by 2: the orthogonal R closest to the previous W_K
        wk_new = _polar(wk @ wk_new.T) @ wk_new
    # 4. W_Q with the slots tied to their E-step fixed point mu_i = W_Q^T m_i:
    #    min_P sum_i [N_i m_i^T P^2 m_i - 2 m_i^T P m_i], P = W_Q W_Q^T  <=>  PD + DP = 2B
    m = A.T @ (x @ wk_new.T)  # (S, d_k), m_i = sum_j A_ji k_j
    big_d = jnp.einsum("s,sa,sb->ab", n, m, m)
    big_b = m.T @ m
    d, v = jnp.linalg.eigh(0.5 * (big_d + big_d.T))
    den = d[:, None] + d[None, :]
    ok = den > rtol * jnp.max(d)
    p_tilde = jnp.where(ok, 2.0 * (v.T @ big_b @ v) / jnp.where(ok, den, 1.0), 0.0)
    p_mat = v @ p_tilde @ v.T
    # W_Q W_Q^T = P (its d_mu largest eigenvalues when rank P > d_mu), W_Q the closest
    # such factor to the previous W_Q (fixes the gauge mu -> O mu, W_Q -> W_Q O^T)
    dk = wk.shape[0]
    r = min(dk, wq.shape[-1])
    p, u = jnp.linalg.eigh(0.5 * (p_mat + p_mat.T))
    p, u = p[dk - r:], u[:, dk - r:]
    p = jnp.where(p > rtol * jnp.max(p), p, 0.0)
    factor = u * jnp.sqrt(p)  # (d_k, r), factor factor^T = P
    wq_new = factor @ _polar(factor.T @ wq)
    return _poison(rtol, wk_new, wq_new, m @ wq_new)


class SlotState(NamedTuple):
    r"""[`slot_em`][structinfer.infer.slot_em] state: slots, projections, attention and free energy.

    Attributes:
        slots: `(S, d_mu)` slot means $\mu_i$.
        wk: `(d_k, d_x)` key projection $W_K$.
        wq: `(d_k, d_mu)` query projection $W_Q$.
        attention: `(tokens, S)` $A_{ji} = p(\phi_j = i \mid x)$ at the slots.
        energy: the collapsed free energy $F = \tfrac12\|\mu\|^2 - \log Z(\mu; W)$.
    """

    slots: jax.Array
    wk: jax.Array
    wq: jax.Array
    attention: jax.Array
    energy: jax.Array


def _prepare(x, slots, wk, wq):
    x = as_float_array(x, "slot_em: x")
    check_linalg_dtype(x, "slot_em: x")
    check_layout(x, 2, "slot_em: x", "(tokens, d_x)",
                 "; for a batch of token sets map slot_em over it with jax.vmap")
    check_nonempty(x, "slot_em: x", "(tokens, d_x)")
    slots = jnp.asarray(slots, x.dtype)
    wk, wq = jnp.asarray(wk, x.dtype), jnp.asarray(wq, x.dtype)
    check_layout(slots, 2, "slot_em: slots", "(S, d_mu)")
    check_layout(wk, 2, "slot_em: wk", "(d_k, d_x)")
    check_layout(wq, 2, "slot_em: wq", "(d_k, d_mu)")
    if wk.shape[-1] != x.shape[-1] or wq.shape[-1] != slots.shape[-1] or wk.shape[0] != wq.shape[0]:
        raise ValueError(
            f"slot_em: wk {tuple(wk.shape)} must be (d_k, d_x={x.shape[-1]}) and wq "
            f"{tuple(wq.shape)} (d_k, d_mu={slots.shape[-1]})"
        )
    return x, slots, wk, wq


def _check_ridge(ridge):
    return check_nonnegative(ridge, "slot_em: ridge",
                             "added to the token Gram matrix and the within-slot scatter")


def _model(x, slots, wk, wq):
    """The slot-attention mechanism at slot values `slots`, as `(model, args, kwargs)`."""
    model = substitute(slot_attention, data={"slots": slots})
    return model, (x, wq, wk, slots.shape[-2]), dict(node_potential=False, slot_dim=slots.shape[-1])


def _e_step(x, slots, wk, wq, e_iters):
    """CCCP on the slots and the attention at its result.

    A CCCP that stopped on a non-finite energy hands back its last finite slots; that is
    no fixed point, so the state's energy is the non-finite one, for the outer loop to
    stop on.
    """
    e_iters = check_count(e_iters, "slot_em: e_iters", role="the CCCP steps of each E-step")

    def log_z(mu):
        model, args, kw = _model(x, mu, wk, wq)
        return log_marginal(model, *args, **kw)

    st, info = convex_concave.run(log_z, slots, max_iters=e_iters, raise_on_nonfinite=False)
    model, args, kw = _model(x, st.mu, wk, wq)
    att = marginals(model, *args, **kw)["phi"].astype(x.dtype)
    energy = jnp.where(info.nonfinite, info.final_energy(), st.energy)
    return SlotState(st.mu, wk, wq, att, energy.astype(x.dtype))


def init(
    x: ArrayLike, slots: ArrayLike, wk: ArrayLike, wq: ArrayLike, *, e_iters: int = 20
) -> SlotState:
    r"""Check and cast the arguments and run the first E-step (CCCP on the slots $\mu$).

    Args:
        x: `(tokens, d_x)`.
        slots: `(S, d_mu)` initial slots.
        wk: `(d_k, d_x)`.
        wq: `(d_k, d_mu)`.
        e_iters: CCCP steps of the E-step (a positive int).

    Returns:
        The `SlotState` after `e_iters` CCCP steps from `slots` at `wk`, `wq`; its energy
            is not finite when the CCCP stopped on a non-finite energy (the slots are
            then its last finite ones).

    Raises:
        TypeError: `x` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: no tokens, arrays that are not `(tokens, d_x)`, `(S, d_mu)`, `(d_k, d_x)`,
            `(d_k, d_mu)` with matching sizes, or `e_iters` not a positive int.
    """
    return _e_step(*_prepare(x, slots, wk, wq), e_iters)


def _init(x, slots, wk, wq, *, e_iters, whiten):
    del whiten  # (an M-step option: `iterate` hands both functions the same)
    return _e_step(x, slots, wk, wq, e_iters)


def _energy(state: SlotState) -> jax.Array:
    return state.energy


def step(
    x: jax.Array,
    state: SlotState,
    *,
    e_iters: int = 20,
    whiten: bool = True,
    ridge: float = 0.0,
    tol: float = 1e-6,
    rtol: float | None = None,
) -> tuple[SlotState, jax.Array]:
    r"""One EM iteration: `tied_m_step` at `state`, then the E-step from the slots it returns.

    Args:
        x: `(tokens, d_x)` (as cast by `init`).
        state: the current `SlotState`.
        e_iters: CCCP steps per E-step (a positive int).
        whiten: steps 2–3 of [`slot_em`][structinfer.infer.slot_em].
        ridge: added to $\sum A x x^\top$ and to the within-slot scatter
            (non-negative).
        tol: relative tolerance of the convergence test (a non-negative number;
            anything else raises `ValueError`).
        rtol: eigenvalue cut-off relative to the largest eigenvalue, in ``[0, 1)``;
            default ``10 * max(shape) * eps(dtype)``.

    Returns:
        `(new_state, converged)`: the energy, $W_K$, $W_Q$ and the slots all changed
            by at most `tol` relatively. The new energy is not finite when the E-step's
            CCCP stopped on a non-finite energy.

    Raises:
        ValueError: `e_iters` not a positive int, a negative `ridge` or an `rtol`
            outside `[0, 1)` (a traced one makes the state NaN instead).
    """
    tol = check_tol(tol, "slot_em: tol")
    ridge = _check_ridge(ridge)
    if rtol is None:
        rtol = _default_rtol(x.dtype, *state.wk.shape, *state.wq.shape, *state.slots.shape)
    rtol = _check_rtol(rtol, "slot_em: rtol")
    wk, wq, mu0 = tied_m_step(x, state.slots, state.attention, state.wk, state.wq,
                              whiten=whiten, ridge=ridge, rtol=rtol)
    new = _e_step(x, mu0, wk, wq, e_iters)
    conv = rel_change_small(new.energy, state.energy, tol) & rel_change_small_tree(
        (new.wk, new.wq, new.slots), (state.wk, state.wq, state.slots), tol)
    return new, conv


def run(
    x: ArrayLike,
    slots: ArrayLike,
    wk: ArrayLike,
    wq: ArrayLike,
    *,
    e_iters: int = 20,
    whiten: bool = True,
    ridge: float = 0.0,
    tol: float = 1e-6,
    max_iters: int = 50,
    raise_on_nonfinite: bool = True,
    rtol: float | None = None,
) -> tuple[SlotState, LoopInfo]:
    r"""Slot attention with learned $W_K, W_Q$: E-step on the slots, WLS M-step.

    E-step: ``e_iters`` CCCP steps on the slots of
    [`slot_attention`][structinfer.mechanisms.slot_attention] (without its node
    potential),

    $$
    \mu_i \leftarrow W_Q^\top m_i,\qquad m_i = \sum_j A_{ji} k_j,\quad
    A_{ji} = \mathrm{softmax}_i(k_j^\top W_Q \mu_i),\quad k_j = W_K x_j
    $$

    (Singh & Buckley eq. 8, node potential $\tfrac12\|\mu\|^2$), and the attention
    $A$ at the result. M-step, at that attention, with $N_i = \sum_j A_{ji}$:

    1. $W_K$ by weighted least squares given the queries $q_i = W_Q\mu_i$,
        $W_K = (\sum A_{ji} q_i x_j^\top)(\sum A_{ji} x_j x_j^\top)^{+}$.
    2. (``whiten``) $W_K \leftarrow (W_K \Sigma_w W_K^\top)^{+1/2} W_K$,
        $\Sigma_w = \sum_{ji} A_{ji}(x_j-\bar x_i)(x_j-\bar x_i)^\top / \sum A$,
        $\bar x_i = \sum_j A_{ji}x_j / N_i$: unit within-slot key covariance, i.e.
        the residual covariance of $\sum A\|k_j - q_i\|^2$ read as a Gaussian
        likelihood, at its best $q_i = \bar k_i$, absorbed into $W_K$ (this
        sets the scale of the scores, hence how sharp the attention is). The
        pseudo-inverse square root acts on the range only: $W_K$ has rank
        $\le \min(S, d_\mu, d_x)$, which can be below $d_k$.
    3. (``whiten``) $W_K \leftarrow R W_K$ with $R$ the orthogonal matrix
        closest to the previous $W_K$ (Procrustes): 2. leaves a rotation of the key
        space free, which changes no score.
    4. $W_Q$ with the slots tied to the E-step's fixed point
        $\mu_i = W_Q^\top m_i$: the weighted least squares
        $\sum A_{ji}\|k_j - W_Q\mu_i\|^2$ then depends on $W_Q$ only through
        $P = W_Q W_Q^\top$,

        $$
        \min_P \sum_i N_i m_i^\top P^2 m_i - 2\, m_i^\top P m_i
        \iff PD + DP = 2B,\quad D = \textstyle\sum_i N_i m_i m_i^\top,\
        B = \textstyle\sum_i m_i m_i^\top,
        $$

        a strictly convex quadratic on the range of $D$, solved in $D$'s
        eigenbasis ($\tilde P_{ab} = 2\tilde B_{ab}/(d_a + d_b)$; $P \succeq 0$).
        $W_Q$ is the factor $W_Q W_Q^\top = P$ closest to the previous
        $W_Q$ (exact when $\mathrm{rank}\,P \le d_\mu$, else the
        $d_\mu$ largest eigenvalues of $P$), and the next E-step starts from
        $\mu_i = W_Q^\top m_i$.

    Solving $W_Q$ against the previous E-step's slots instead (as
    [`slot_m_step`][structinfer.infer.slot_m_step] does) is ill-posed: the WLS $W_Q$
    scales as $1/|\mu|$ and the E-step's $\mu$ as $|W_Q|$, so $|W_Q|$
    alternates between two values forever; step 4 removes that gauge
    ($|W_Q|^2 \approx 1/N_i$, queries $q_i \approx \bar k_i$).

    Converged when the energy, $W_K$, $W_Q$ and the slots all changed by at
    most ``tol`` relatively in the last iteration
    ($|\Delta F| \le \mathrm{tol}\max(1,|F|)$,
    $\|\Delta\theta\|_F \le \mathrm{tol}\,\|\theta\|_F$). ``info.energy`` is the
    collapsed free energy $F = \tfrac12\|\mu\|^2 - \log Z(\mu; W)$ after each
    iteration; the WLS M-step is a surrogate ($F$ is unbounded below in the scale
    of $W$), so $F$ is reported, not guaranteed to decrease.

    The dot-product score prefers the slot with the largest projection, not the nearest
    one: clusters must differ in direction (after $W_K$), and slots that lose all
    their tokens in the first E-step (eq. 8 sums over a slot's tokens, so attention is
    rich-get-richer) stay empty — initialise the slots near distinct tokens.

    Args:
        x: ``(tokens, d_x)``.
        slots: ``(S, d_mu)`` initial slots.
        wk: ``(d_k, d_x)``; any ``d_k`` (also ``d_k > S``).
        wq: ``(d_k, d_mu)``.
        e_iters: CCCP steps per E-step (a positive int). A CCCP that stops on a
            non-finite energy is a non-finite energy of its EM iteration
            (`info.nonfinite`; the state is the last one with a finite energy).
        whiten: steps 2–3; without them the scale of $W_K$ is not fixed (the WLS
            objective is minimised by $W = 0$).
        ridge: added to $\sum A x x^\top$ and to the within-slot scatter
            $\sum A (x-\bar x)(x-\bar x)^\top$; use it when a slot's tokens can
            coincide (zero within-slot spread makes the attention arbitrarily sharp).
            Non-negative (under `jax.jit`, where it cannot be checked, a negative
            `ridge` gives a NaN energy: `info.nonfinite`).
        tol: relative tolerance for the convergence test above.
        max_iters: the most EM iterations; stopping there is reported in
            ``info.max_iters_reached``.
        raise_on_nonfinite: raise [`NonFiniteEnergyError`][structinfer.infer.NonFiniteEnergyError]
            when the result is concrete and an energy was not finite.
        rtol: eigenvalue cut-off relative to the largest eigenvalue (pseudo-inverses,
            whitening, $P$), in ``[0, 1)`` (``>= 1`` would cut them all); default
            ``10 * max(shape) * eps(dtype)``. Under `jax.jit`, where it cannot be
            checked, one outside ``[0, 1)`` gives a NaN energy (`info.nonfinite`).

    Returns:
        ``(SlotState, LoopInfo)``.

    Raises:
        TypeError: `x` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: no tokens, arrays that are not ``(tokens, d_x)``, ``(S, d_mu)``,
            ``(d_k, d_x)``, ``(d_k, d_mu)`` with matching sizes (for a batch use
            ``jax.vmap``), ``e_iters`` not a positive int, a negative ``ridge``, an
            ``rtol`` outside ``[0, 1)``, or a ``tol`` that is not a non-negative number.
        NonFiniteEnergyError: see ``raise_on_nonfinite``.

    Reference:
        Singh & Buckley sec. 4.3 and Table 1 (slot attention, eq. 8 E-step);
        Tschantz, coordinate ascent for $W_K, W_Q$.
    """
    x, slots, wk, wq = _prepare(x, slots, wk, wq)
    ridge = _check_ridge(ridge)
    rtol = (_default_rtol(x.dtype, *wk.shape, *wq.shape, *slots.shape) if rtol is None
            else _check_rtol(rtol, "slot_em: rtol"))
    e_iters = check_count(e_iters, "slot_em: e_iters", role="the CCCP steps of each E-step")
    state, info = iterate(_init, step, _energy, (x, slots, wk, wq), (x,),
                          {"ridge": ridge, "tol": check_tol(tol, "slot_em: tol"), "rtol": rtol},
                          max_iters, "slot_em",
                          {"e_iters": e_iters, "whiten": bool(whiten)})
    if raise_on_nonfinite:
        check(info, "slot_em", "'phi' (in the E-step's CCCP on the slots)")
    return state, info
