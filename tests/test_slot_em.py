"""Slot EM (``structinfer.infer.slot_em`` / ``slot_m_step``): well-posed for any shapes,
honest convergence, and recovery of separated clusters (issue "Trust at every size", item 8).

Regressions:

* key dim > number of slots: the whitening divided by ``sqrt(max(eig, 1e-30))`` of a
  singular matrix, so 1e-12 input noise moved ``W_K`` by O(1) (float64) and ``W_K`` was
  ~1e15 (float32);
* three separated clusters: every slot collapsed onto one point, ``W_Q``'s scale flipped
  between two values every iteration, and ``status`` still said converged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import float64, matrix
from sklearn.metrics import adjusted_rand_score

from structinfer.infer import slot_em, slot_m_step
from structinfer.infer.em_slot import tied_m_step


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    if request.param == "float64":
        with float64():
            yield np.float64
    else:
        yield np.float32


def two_blobs(dtype, seed=4):
    """The shapes of ``test_slot_em_runs_and_reports``: 14 tokens in 3-D, 2 slots, d_k = 3."""
    r = np.random.default_rng(seed)
    x = np.concatenate([r.normal(size=(7, 3)) + 3, r.normal(size=(7, 3)) - 3]).astype(dtype)
    return x, r


def three_clusters(dtype, seed=0, n=20, sep=4.0, sd=0.3, d_mu=3):
    """Three well-separated clusters at ``sep * e_c`` and initial slots near one token of
    each (zero-padded to ``d_mu``)."""
    r = np.random.default_rng(seed)
    labels = np.repeat(np.arange(3), n)
    x = (sep * np.eye(3)[labels] + sd * r.normal(size=(3 * n, 3))).astype(dtype)
    near = x[[0, n, 2 * n]] + 0.5 * r.normal(size=(3, 3))
    slots0 = np.zeros((3, d_mu))
    slots0[:, : min(3, d_mu)] = near[:, : min(3, d_mu)]
    return x, labels, slots0.astype(dtype)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def test_slot_m_step_whitens_on_the_range_when_keys_outnumber_slots(dtype):
    """d_k = 5 > S = 2: W_K after the WLS solve has rank <= 2, so W_K C W_K^T is singular.
    Whitening on its range gives an orthogonal projector of rank 2 and is continuous in x."""
    r = np.random.default_rng(3)
    n, S, dx, dm, dk = 13, 2, 4, 3, 5
    x = r.normal(size=(n, dx)).astype(dtype)
    mu = r.normal(size=(S, dm)).astype(dtype)
    A = r.dirichlet(np.ones(S), size=n).astype(dtype)
    wk, wq = r.normal(size=(dk, dx)).astype(dtype), r.normal(size=(dk, dm)).astype(dtype)
    step = jax.jit(lambda x: slot_m_step(x, mu, A, wk, wq, whiten=True))
    wk1, _ = step(x)
    cxx = np.einsum("js,ja,jb->ab", A, x, x) / A.sum()
    proj = np.asarray(wk1 @ cxx @ wk1.T, np.float64)
    atol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(proj, proj.T, atol=atol)
    np.testing.assert_allclose(proj @ proj, proj, atol=atol)
    np.testing.assert_allclose(np.trace(proj), S, atol=atol)
    assert np.abs(np.asarray(wk1)).max() < 1e3
    delta = 1e-5 if dtype == np.float32 else 1e-12
    wk2, _ = step((x + delta * r.normal(size=x.shape)).astype(dtype))
    assert np.abs(np.asarray(wk2 - wk1)).max() < (1e-2 if dtype == np.float32 else 1e-8)


def test_slot_em_is_continuous_in_the_input_when_keys_outnumber_slots(dtype):
    """The issue's case: 1e-12 input noise (float64; 1e-5 in float32) after 3 iterations
    moves W_K and W_Q by about as much, not by O(1) or 1e15."""
    x, r = two_blobs(dtype)
    eye = jnp.eye(3, dtype=dtype)
    run = jax.jit(lambda x: slot_em(x, 0.1 * jnp.ones((2, 3), dtype) + jnp.eye(2, 3, dtype=dtype),
                                    eye, eye, e_iters=5, max_iters=3))
    a, ia = run(x)
    delta = 1e-5 if dtype == np.float32 else 1e-12
    b, ib = run((x + delta * r.normal(size=x.shape)).astype(dtype))
    bound = 1e-3 if dtype == np.float32 else 1e-8
    for name in ("wk", "wq"):
        wa, wb = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert np.all(np.isfinite(wa)) and np.abs(wa).max() < 1e3, (name, wa)
        assert np.abs(wa - wb).max() < bound, (name, np.abs(wa - wb).max())
    np.testing.assert_allclose(ia.final_energy(), ib.final_energy(),
                               rtol=1e-3 if dtype == np.float32 else 1e-8)
    np.testing.assert_allclose(a.attention.sum(1), 1.0, atol=1e-5)


# (each member compiles the whole EM loop twice) default tier: (float64, d_k = 5 > d_mu = 4)
# (the float32 EM loop runs in this file's other tests); the other three pairs run in the
# exhaustive tier
@pytest.mark.parametrize("dtype,dk,d_mu", matrix(
    [("float32", 3, 3), ("float32", 5, 4), ("float64", 3, 3), ("float64", 5, 4)],
    keep=lambda t, dk, d_mu: t == "float64" and dk == 5), indirect=["dtype"])
def test_slot_em_recovers_separated_clusters(dtype, dk, d_mu):
    """Three clusters 4 apart with spread 0.3: the MAP slot of every token is its cluster
    (ARI 1), the run converges, and it has converged: one more EM iteration from the
    returned state leaves the energy, W_K, W_Q and the slots where they are."""
    x, labels, slots0 = three_clusters(dtype, d_mu=d_mu)
    wk0, wq0 = np.eye(dk, 3, dtype=dtype), np.eye(dk, d_mu, dtype=dtype)
    run = jax.jit(lambda x, s, wk, wq, k: slot_em(x, s, wk, wq, max_iters=k), static_argnums=4)
    st, info = run(x, slots0, wk0, wq0, 50)
    att = np.asarray(st.attention)
    ari = adjusted_rand_score(labels, att.argmax(1))
    assert ari > 0.9, (ari, att.sum(0))
    assert len(np.unique(att.argmax(1))) == 3
    assert bool(info.converged) and int(info.num_steps) < 50
    np.testing.assert_allclose(att.sum(1), 1.0, atol=1e-5)
    # the claim "converged" is checked: continue the iteration
    st2, info2 = run(x, st.slots, st.wk, st.wq, 1)
    tol = 1e-3 if dtype == np.float32 else 1e-6
    for name in ("wk", "wq", "slots"):
        assert _rel(getattr(st2, name), getattr(st, name)) < tol, name
    e, e2 = float(info.final_energy()), float(info2.final_energy())
    assert abs(e2 - e) <= tol * max(1.0, abs(e))


# default tier: float64 (float32 runs in the exhaustive tier; both dtypes run the
# "converged survives one more iteration" checks of the two tests beside it by default)
@pytest.mark.parametrize("dtype", matrix(["float32", "float64"], keep=lambda t: t == "float64"),
                         indirect=True)
def test_slot_em_does_not_report_converged_while_w_q_flips(dtype):
    """The scale of W_Q must settle: between consecutive iterations its norm stays put (it
    used to flip by a factor ~20 every iteration, with status converged), and a reported
    convergence survives one more iteration."""
    x, _, slots0 = three_clusters(dtype)
    eye = np.eye(3, dtype=dtype)
    step = jax.jit(lambda s, wk, wq: slot_em(x, s, wk, wq, max_iters=1, tol=0.0))
    st, norms = None, []
    for _ in range(6):
        st, _ = step(*((slots0, eye, eye) if st is None else (st.slots, st.wk, st.wq)))
        norms.append(float(np.linalg.norm(np.asarray(st.wq))))
    ratios = np.array(norms[2:]) / np.array(norms[1:-1])  # the first step leaves W_Q = I
    assert np.all(np.abs(ratios - 1) < 1e-2), norms
    st, info = jax.jit(lambda: slot_em(x, slots0, eye, eye, max_iters=50))()
    assert bool(info.converged)
    st2, _ = step(st.slots, st.wk, st.wq)
    assert _rel(st2.wq, st.wq) < 1e-3 and _rel(st2.wk, st.wk) < 1e-3


def _ring_clusters(seed):
    """Three clusters 120 degrees apart on a ring at height 4 (all share the offset e_z)."""
    r = np.random.default_rng(seed)
    labels = np.repeat(np.arange(3), 20)
    ang = 2 * np.pi * np.arange(3) / 3
    centres = np.stack([4 * np.cos(ang), 4 * np.sin(ang), 4 * np.ones(3)], 1)
    return centres[labels] + 0.3 * r.normal(size=(60, 3)), r


# default tier: (float32, empty_slot) and (float64, key_subspace_turns), both dtypes and
# both cases; the other two pairs run in the exhaustive tier
@pytest.mark.parametrize("dtype,case", matrix(
    [(t, c) for t in ("float32", "float64") for c in ("key_subspace_turns", "empty_slot")],
    keep=lambda t, c: (t == "float64") == (c == "key_subspace_turns")), indirect=["dtype"])
def test_slot_em_converged_means_settled(dtype, case):
    """``status == converged`` only when the energy and W_K, W_Q, the slots have settled.

    * ``key_subspace_turns``: d_k = 2 keys for 3-D tokens. The attention stops changing
      after one iteration while W_K's row space keeps turning for ~50 more (a criterion
      on the attention alone stopped there, W_K still moving 3e-3 per iteration).
    * ``empty_slot``: random initial slots; one slot loses all its tokens in the first
      E-step and W_K has rank 2 < d_k. The whitening leaves a rotation of the key space
      free; unless it is fixed, W_K, W_Q and the slots rotate forever (no convergence).
    """
    x, r = _ring_clusters(0)
    if case == "key_subspace_turns":
        slots0 = (x[[0, 20, 40]] + 0.5 * r.normal(size=(3, 3)))[:, :2]
        wk0, wq0 = np.eye(2, 3) + 0.3 * r.normal(size=(2, 3)), np.eye(2)
    else:
        slots0 = r.normal(size=(3, 3))
        wk0, wq0 = (np.eye(3) + 0.1 * r.normal(size=(3, 3)) for _ in range(2))
    x, slots0, wk0, wq0 = (np.asarray(a, dtype) for a in (x, slots0, wk0, wq0))
    run = jax.jit(lambda s, wk, wq, k: slot_em(x, s, wk, wq, max_iters=k), static_argnums=3)
    st, info = run(slots0, wk0, wq0, 200)
    assert bool(info.converged), (int(info.status), int(info.num_steps))
    st2, _ = run(st.slots, st.wk, st.wq, 1)
    tol = 1e-4 if dtype == np.float32 else 1e-8
    for name in ("wk", "wq", "slots"):
        assert _rel(getattr(st2, name), getattr(st, name)) < tol, name


def test_slot_em_m_step_solves_the_tied_least_squares(x64):
    """The M-step of slot_em against plain linear algebra: unit within-slot key
    covariance, W_Q W_Q^T = P solving PD + DP = 2B (the minimiser of
    sum_ji A_ji |k_j - W_Q W_Q^T m_i|^2 over P; here by a Kronecker solve), and the slots
    at the E-step's fixed point mu_i = W_Q^T m_i."""
    r = np.random.default_rng(11)
    n, S, dx, dm, dk = 17, 4, 5, 4, 3
    x, mu = r.normal(size=(n, dx)), r.normal(size=(S, dm))
    A = r.dirichlet(np.ones(S), size=n)
    wk, wq = r.normal(size=(dk, dx)), r.normal(size=(dk, dm))
    wk1, wq1, mu1 = tied_m_step(x, mu, A, wk, wq, whiten=True, ridge=0.0, rtol=1e-13)
    wk1, wq1, mu1 = (np.asarray(a) for a in (wk1, wq1, mu1))
    N = A.sum(0)
    xbar = (A.T @ x) / N[:, None]
    sw = sum(A[j, i] * np.outer(x[j] - xbar[i], x[j] - xbar[i])
             for j in range(n) for i in range(S)) / A.sum()
    np.testing.assert_allclose(wk1 @ sw @ wk1.T, np.eye(dk), atol=1e-10)
    m = A.T @ (x @ wk1.T)
    D = sum(N[i] * np.outer(m[i], m[i]) for i in range(S))
    B = m.T @ m
    P = np.linalg.solve(np.kron(np.eye(dk), D) + np.kron(D, np.eye(dk)),
                        2 * B.reshape(-1)).reshape(dk, dk)
    np.testing.assert_allclose(wq1 @ wq1.T, P, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(mu1, m @ wq1, atol=1e-10)

    def objective(w):
        keys = x @ wk1.T
        q = (m @ w) @ w.T  # W_Q mu_i with mu_i = W_Q^T m_i
        return jnp.sum(A[..., None] * (keys[:, None, :] - q[None]) ** 2)

    g = np.asarray(jax.grad(objective)(jnp.asarray(wq1)))
    assert np.abs(g).max() < 1e-8 * float(objective(wq1))


def test_slot_em_surfaces_a_failed_e_step():
    """Regression: the E-step's CCCP ran with raise_on_nonfinite=False and, when it
    overflowed, handed back its starting slots with a finite energy, so a failed E-step
    looked like a finished one. It is now a non-finite energy at that step (here the
    first E-step: the initial state)."""
    from structinfer.infer import NonFiniteEnergyError, em_slot

    x, _ = two_blobs(np.float32)
    x = x * np.float32(1e19)  # the slots' squared norm overflows float32 after one step
    slots = np.array([[1e-3, 0.0], [0.0, 1e-3]], np.float32)
    wk, wq = np.eye(2, 3, dtype=np.float32), np.eye(2, dtype=np.float32)
    st = em_slot.init(x, slots, wk, wq, e_iters=5)
    assert not np.isfinite(float(st.energy))
    with pytest.raises(NonFiniteEnergyError, match="slot_em: .*initial state.*E-step") as err:
        slot_em(x, slots, wk, wq, e_iters=5)
    assert err.value.step == 0
    _, info = slot_em(x, slots, wk, wq, e_iters=5, raise_on_nonfinite=False)
    assert bool(info.nonfinite) and int(info.num_steps) == 0


def test_slot_em_names_bad_arguments():
    """Regression: e_iters=0 said "max_iters must be a positive int" and 1-D slots gave an
    IndexError."""
    from structinfer.infer import em_slot

    x, _ = two_blobs(np.float32)
    slots, wk, wq = x[[0, 9]][:, :2], np.eye(2, 3), np.eye(2)
    for e_iters in (0, -2, 1.5):
        with pytest.raises(ValueError, match=f"slot_em: e_iters must be a positive int.*got "
                           f"{e_iters!r}"):
            slot_em(x, slots, wk, wq, e_iters=e_iters)
    with pytest.raises(ValueError, match="slot_em: e_iters must be a positive int"):
        em_slot.init(x, slots, wk, wq, e_iters=0)
    with pytest.raises(ValueError, match=r"slot_em: slots must be \(S, d_mu\), got shape \(2,\)"):
        slot_em(x, slots[0], wk, wq)
    with pytest.raises(ValueError, match=r"slot_em: x must be \(tokens, d_x\), got shape "
                       r"\(1, 14, 3\)"):
        slot_em(x[None], slots, wk, wq)
    with pytest.raises(ValueError, match=r"slot_em: wk must be \(d_k, d_x\)"):
        slot_em(x, slots, np.ones(3), wq)
    with pytest.raises(ValueError, match="slot_em: ridge must be a non-negative number.*got -1"):
        slot_em(x, slots, wk, wq, ridge=-1.0)
    att = np.full((len(x), 2), 0.5)
    with pytest.raises(ValueError, match="slot_m_step: ridge must be a non-negative number"):
        slot_m_step(x, slots, att, wk, wq, ridge=-1.0)
    # Regression: bfloat16 data crashed inside jnp.linalg ("Unsupported dtype bfloat16"),
    # naming neither the function nor the argument
    xb = jnp.asarray(x, jnp.bfloat16)
    with pytest.raises(TypeError, match="slot_em: x is bfloat16: .*float32 or float64"):
        slot_em(xb, slots, wk, wq)
    with pytest.raises(TypeError, match="slot_em: x is bfloat16"):
        jax.jit(lambda x: slot_em(x, slots, wk, wq))(xb)
    with pytest.raises(TypeError, match="slot_m_step: x is bfloat16"):
        slot_m_step(xb, slots, att, wk, wq)


def test_slot_em_rejects_rtol_outside_unit_interval():
    """Regression: ``rtol`` was never checked. A NaN or ``rtol >= 1`` cut every eigenvalue,
    so ``W_K = 0``, the attention was uniform and the run reported ``converged`` with
    energy 0 (a finite wrong answer); a negative one gave NaN ``W_K`` from `slot_m_step`
    without saying why."""
    from structinfer.infer import em_slot

    x, _ = two_blobs(np.float32)
    slots, wk, wq = x[[0, 9]][:, :2], np.eye(2, 3), np.eye(2)
    att = np.full((len(x), 2), 0.5, np.float32)
    state = em_slot.init(x, slots, wk, wq, e_iters=1)
    for rtol in (-1.0, float("nan"), 1.0, 2.0):
        with pytest.raises(ValueError, match=r"slot_em: rtol must be a number in \[0, 1\)"):
            slot_em(x, slots, wk, wq, rtol=rtol)
        with pytest.raises(ValueError, match=r"slot_m_step: rtol must be a number in \[0, 1\)"):
            slot_m_step(x, slots, att, wk, wq, rtol=rtol)
        with pytest.raises(ValueError, match=r"slot_em: rtol must be a number in \[0, 1\)"):
            em_slot.step(jnp.asarray(x), state, rtol=rtol, e_iters=1)
    # traced, it cannot be checked: NaN, never a finite wrong answer
    run = jax.jit(lambda r: slot_em(x, slots, wk, wq, rtol=r, max_iters=1, e_iters=1)[1])
    assert bool(run(2.0).nonfinite) and not bool(run(0.0).nonfinite)
    wk1, _ = jax.jit(lambda r: slot_m_step(x, slots, att, wk, wq, rtol=r))(2.0)
    assert np.isnan(np.asarray(wk1)).all()
