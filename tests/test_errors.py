"""Bad input gets a clear error that names the site and what was expected."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.contrib.control_flow import scan
from numpyro.handlers import substitute

import structinfer as si

N, M, D = 5, 7, 3
r = np.random.default_rng(0)
XQ, XK, V = r.normal(size=(N, D)), r.normal(size=(M, D)), r.normal(size=(M, 2))


def test_edge_outside_plate():
    def model():
        si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))

    with pytest.raises(ValueError, match=r"edge\('phi'\) must be called inside a numpyro.plate"):
        si.log_marginal(model)


def test_children_plate_not_rightmost():
    def model():
        with numpyro.plate("queries", N, dim=-2):
            si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))

    with pytest.raises(ValueError, match="edge site 'phi': no plate at dim=-1"):
        si.log_marginal(model)


def test_prior_support_does_not_match_score():
    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Uniform(M + 1), si.scores.Dot(XQ, XK))

    with pytest.raises(ValueError, match=r"edge site 'phi': score has 7 parents .* prior has 8"):
        si.log_marginal(model)


def test_score_children_do_not_match_plate():
    def model():
        with numpyro.plate("queries", N + 1):
            si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))

    with pytest.raises(ValueError, match=r"edge site 'phi': score of shape \(5, 7\) does not fit"):
        si.log_marginal(model)


def test_extra_batch_dims_without_plate():
    q = np.stack([XQ, XQ])

    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Uniform(M), si.scores.Dot(q, XK))

    with pytest.raises(ValueError, match="more batch dims than the plates"):
        si.log_marginal(model)


@pytest.mark.parametrize("site", ["obs", "factor"])
def test_a_site_with_batch_dims_outside_any_plate_is_named(site):
    """A vector observation or factor outside a plate next to an edge: the left-over dim
    error names the site and the fix (was a list of causes none of which was this one)."""
    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))
        with numpyro.plate("ok", 3):  # a plated vector site is fine
            numpyro.sample("z", dist.Normal(0.0, 1.0), obs=jnp.ones(3))
        numpyro.sample("y2", dist.Normal(jnp.zeros(3), 1.0).to_event(1), obs=jnp.ones(3))
        if site == "obs":
            numpyro.sample("y", dist.Normal(0.0, 1.0), obs=jnp.ones(3))
        else:
            numpyro.factor("y", jnp.ones(3))

    with pytest.raises(ValueError, match=r"site 'y' has batch shape \(3,\) with no plate at "
                       r"dim -1 .*to_event") as err:
        si.log_marginal(model)
    assert "'z'" not in str(err.value) and "'y2'" not in str(err.value)


def test_child_with_no_parent():
    mask = np.ones((N, M), bool)
    mask[3] = False
    restricted = si.priors.Restricted(mask)  # checked where an edge uses it: named there

    def masked():
        with numpyro.plate("queries", N):
            si.edge("phi", restricted, si.scores.Dot(XQ, XK))

    for run in (si.log_marginal, jax.jit(si.log_marginal, static_argnums=0)):
        with pytest.raises(  # a ValueError, as its type says
            si.priors.NoParentError,
            match="edge site 'phi': Restricted prior allows no parent for child 3",
        ):
            run(masked)

    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Geometric(0.5, M, include_self=False), si.scores.Dot(XQ, XK))

    with pytest.raises(
        si.priors.NoParentError,
        match="edge site 'phi': Geometric prior allows no parent for child 0",
    ):
        si.log_marginal(model)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_score(bad):
    s = XQ @ XK.T
    s[2, 4] = bad

    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Uniform(M), s)

    with pytest.raises(
        ValueError, match=r"edge site 'phi': score contains (NaN|inf) at index \(2, 4\)"
    ):
        si.log_marginal(model)


def _forbidding_score(kind, forbid):
    """A score with -inf at the ``forbid`` (child, parent) pairs, its finite table (NumPy)."""
    if kind == "custom":
        table = XQ @ XK.T
        s = table.copy()
        s[tuple(np.transpose(forbid))] = -np.inf
        return (lambda s: si.scores.Custom(s)), s, table
    # NegSqDist's log mixing weights: -inf forbids a parent for every child
    table = -0.5 * ((XQ[:, None] - XK[None]) ** 2).sum(-1)
    log_w = np.zeros(M)
    log_w[sorted({j for _, j in forbid})] = -np.inf
    return (lambda w: si.scores.NegSqDist(XQ, XK, log_weights=w)), log_w, table


@pytest.mark.parametrize("kind", ["custom", "neg_sq_dist"])
def test_a_minus_inf_score_is_a_forbidden_edge_everywhere(kind):
    """Regression: a -inf entry of a Custom score table or of NegSqDist's log_weights
    raised eagerly in the exact engine, while jit and si.attention read it as a forbidden
    edge. It is a forbidden edge everywhere (as a -inf Markov transition and a masked prior
    are): eager, jit and si.attention against a NumPy softmax without the entry. A child
    left no parent is the engine's error for an empty prior row eagerly, NaN under jit."""
    forbid = [(2, 4), (3, 0), (3, 1)] if kind == "custom" else [(0, 4), (0, 6)]
    make, arg, table = _forbidding_score(kind, forbid)

    def model(arg):
        with numpyro.plate("queries", N):
            j = si.edge("phi", si.priors.Uniform(M), make(arg))
            numpyro.deterministic("out", jnp.asarray(V)[j])

    allowed = np.ones((N, M), bool)
    if kind == "custom":
        allowed[tuple(np.transpose(forbid))] = False
    else:  # a weight forbids its parent for every child
        allowed[:, [j for _, j in forbid]] = False
    w = np.where(allowed, np.exp(table - table.max(-1, keepdims=True)), 0.0)
    p = w / w.sum(-1, keepdims=True)
    np.testing.assert_allclose(si.marginals(model, arg)["phi"], p, rtol=1e-5, atol=1e-7)
    for out in (si.expectation(model, "out", arg),
                jax.jit(lambda a: si.expectation(model, "out", a))(arg),
                si.attention(model, "out")(arg),
                jax.jit(si.attention(model, "out"))(arg)):
        np.testing.assert_allclose(out, p @ V, rtol=1e-5, atol=1e-6)

    # every parent of child 1 forbidden (Custom), or every parent at all (NegSqDist)
    if kind == "custom":
        arg = arg.copy()
        arg[1] = -np.inf
    else:
        arg = np.full(M, -np.inf)
    child = 1 if kind == "custom" else 0
    said = f"edge site 'phi': the score allows no parent for child {child}"
    for run in (lambda: si.log_marginal(model, arg), lambda: si.marginals(model, arg),
                lambda: si.attention(model, "out")(arg)):
        with pytest.raises(si.priors.NoParentError, match=said):
            run()
    for out in (jax.jit(lambda a: si.expectation(model, "out", a))(arg),
                jax.jit(si.attention(model, "out"))(arg)):
        assert np.all(np.isnan(np.asarray(out)[child]))


def test_mismatched_feature_sizes():
    with pytest.raises(
        ValueError, match="Dot: child features has feature size 3 but parent features has 4"
    ):
        si.scores.Dot(XQ, np.ones((M, 4)))
    with pytest.raises(ValueError, match="NegSqDist: precision shape"):
        si.scores.NegSqDist(XQ, XK, precision=np.ones((2, 2)))


def test_value_site_without_edge_dependence():
    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))
            numpyro.deterministic("out", jnp.asarray(XQ))

    with pytest.raises(ValueError, match="deterministic site 'out': .*either it depends on no "
                       "edge site"):
        si.expectation(model, "out")


def test_unknown_and_wrong_kind_of_site():
    def model():
        with numpyro.plate("queries", N):
            j = si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))
            numpyro.deterministic("out", V[j])

    with pytest.raises(KeyError, match="no site 'outt'; deterministic sites: \\['out'\\]"):
        si.expectation(model, "outt")
    with pytest.raises(ValueError, match="site 'phi' is a sample site.*use structinfer.marginals"):
        si.expectation(model, "phi")


def test_latent_continuous_site_needs_value():
    def model():
        q = numpyro.sample("q", dist.Beta(2.0, 2.0))
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Geometric(q, M, offset=M - N), si.scores.Dot(XQ, XK))

    with pytest.raises(ValueError, match="sample site 'q' is latent and not enumerable"):
        si.log_marginal(model)
    assert np.isfinite(si.log_marginal(substitute(model, {"q": 0.3})))


def test_bad_score_scale_arguments():
    """A kernel width, a cosine's eps, a linear-Gaussian's precision and a relative-position
    clip out of range are refused, naming the argument (they gave uniform attention, NaN
    scores or a misleading length message)."""
    q = jnp.ones((N, 2))
    with pytest.raises(ValueError, match="GaussianKernel: sigma must be > 0, got 0.0"):
        si.scores.GaussianKernel(q, q, sigma=0.0)
    with pytest.raises(ValueError, match="Cosine: eps must be >= 0, got -1.0"):
        si.scores.Cosine(q, q, eps=-1.0)
    with pytest.raises(ValueError, match="LinearGaussian: precision must be > 0"):
        si.scores.LinearGaussian(q, q, jnp.eye(2)[None], precision=jnp.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="RelativePosition: max_distance must be >= 0"):
        si.priors.RelativePosition(jnp.zeros(3), M, max_distance=-1)
    # traced (under jit) a valid one runs (a bad one is NaN: test_value_checks_of_traced_...)
    jax.jit(lambda s: si.scores.GaussianKernel(q, q, sigma=s).dense())(2.0)


def test_a_geometric_q_that_does_not_fit_the_children_is_named():
    """A per-head ``q`` written ``(heads, 2)`` (not ``(heads, 1)``) gave JAX's bare
    broadcasting error; it names the prior's ``q`` and the children it must fit."""
    with pytest.raises(ValueError, match=r"Geometric prior: q of shape \(2, 2\) does not "
                                         r"broadcast against \(\.\.\., children\) = "
                                         r"\(\.\.\., 6\)"):
        si.priors.Geometric(jnp.full((2, 2), 0.3), 6).log_table(6)
    assert si.priors.Geometric(jnp.full((2, 1), 0.3), 6).log_table(6).shape == (2, 6, 6)


def test_bad_prior_arguments():
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        si.priors.Restricted(np.ones((N, M)))
    with pytest.raises(ValueError, match=r"q must lie in \(0, 1\)"):
        si.priors.Geometric(1.5, M)
    with pytest.raises(TypeError, match="num_parents must be a positive int"):
        si.priors.Uniform(2.5)
    with pytest.raises(ValueError, match="Categorical prior: logits contain NaN"):
        si.priors.Categorical(np.array([0.0, np.nan]))
    with pytest.raises(TypeError, match="edge site 'phi': prior must be a structinfer.priors"):

        def model():
            with numpyro.plate("queries", N):
                si.edge("phi", "uniform", XQ @ XK.T)

        si.log_marginal(model)


def test_relative_position_bias_too_short():
    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.RelativePosition(np.zeros(3), M), si.scores.Dot(XQ, XK))

    with pytest.raises(ValueError, match="RelativePosition: bias has 3 distances"):
        si.log_marginal(model)


def test_enumeration_dim_budget():
    def model():
        with numpyro.plate("queries", 2):
            for k in range(si.exact.MAX_ENUM_DIMS):
                si.edge(f"phi{k}", si.priors.Uniform(2))

    with pytest.raises(ValueError, match="needs 33 tensor dims .* budget of 32"):
        si.log_marginal(model)


def test_numpy_constant_in_closure_under_jit_is_explained():
    Vnp = np.asarray(V)

    def model(xq):
        with numpyro.plate("queries", N):
            j = si.edge("phi", si.priors.Uniform(M), si.scores.Dot(xq, XK))
            numpyro.deterministic("out", Vnp[j])

    with pytest.raises(TypeError, match="indexes a NumPy array with an edge variable"):
        jax.jit(lambda a: si.expectation(model, "out", a))(XQ)
    # eagerly, and with the array passed as an argument, NumPy constants are fine
    ref = jax.nn.softmax(XQ @ XK.T, -1) @ V
    np.testing.assert_allclose(si.expectation(model, "out", XQ), ref, atol=1e-5)


def test_scaled_or_subsampled_edges_are_refused():
    """funsor would scale inside the log-sum-exp (tempering the posterior)."""

    def scaled():
        with numpyro.plate("queries", N), numpyro.handlers.scale(scale=3.0):
            si.edge("phi", si.priors.Uniform(M), XQ @ XK.T)

    def subsampled():
        with numpyro.plate("queries", N, subsample_size=2):
            si.edge("phi", si.priors.Uniform(M), si.scores.Custom(np.zeros((2, M))))

    for model in (scaled, numpyro.handlers.seed(subsampled, 0)):
        with pytest.raises(ValueError, match="edge site 'phi' carries a scale"):
            si.log_marginal(model)


def test_score_with_more_children_than_the_plate():
    def model():
        with numpyro.plate("queries", 1):
            si.edge("phi", si.priors.Uniform(M), np.zeros((3, M)))

    with pytest.raises(ValueError, match=r"score of shape \(3, 7\) does not fit .* \(1,\)"):
        si.log_marginal(model)


def test_ambiguous_or_invalid_precision():
    x, mu = np.zeros((N, 3)), np.zeros((3, 3))  # 3 parents, 3 features
    with pytest.raises(ValueError, match="ambiguous .* pass precision_kind"):
        si.scores.NegSqDist(x, mu, precision=np.ones((3, 3)))
    s = si.scores.NegSqDist(x, mu, precision=np.ones((3, 3)), precision_kind="parent_diag")
    assert s.dense().shape == (N, 3)
    with pytest.raises(ValueError, match="must be positive"):
        si.scores.NegSqDist(x, mu, precision=-np.eye(3), precision_kind="full")
    with pytest.raises(ValueError, match="log_weights has 4 entries"):
        si.scores.NegSqDist(x, mu, log_weights=np.zeros(4))


def test_relative_position_bias_checks_are_static():
    """The length check needs only shapes, so it also runs under jit."""
    f = jax.jit(lambda b: si.priors.RelativePosition(b, M).log_table(N))
    with pytest.raises(ValueError, match="bias has 4 distances"):
        f(jnp.zeros(4))
    with pytest.raises(ValueError, match="max_distance=2 needs 2\\*max_distance\\+1 = 5"):
        si.priors.RelativePosition(np.zeros(9), M, max_distance=2).log_table(N)
    with pytest.raises(ValueError, match="offset -3 puts distances below"):
        si.priors.RelativePosition(np.zeros(20), M, offset=-3).log_table(N)


@pytest.mark.parametrize("prior, score, error, said", [
    (lambda n, X: si.priors.Geometric(jnp.full((n + 1,), 0.3), n),
     lambda X: si.scores.Dot(X, X), ValueError, r"Geometric prior: q of shape \(6,\) "),
    (lambda n, X: si.priors.Uniform(n),
     lambda X: si.scores.NegSqDist(X, X, log_weights=jnp.zeros((3, X.shape[-2]))),
     TypeError, "score NegSqDist: "),
    (lambda n, X: si.priors.Uniform(n), lambda X: si.scores.Dot(X, X, scale=jnp.ones(3)),
     ValueError, "score Dot: "),
    (lambda n, X: si.priors.Uniform(n),
     lambda X: si.scores.LinearGaussian(X, X, jnp.ones((3, X.shape[-1], X.shape[-1]))),
     ValueError, "score LinearGaussian: "),
])
def test_parameters_whose_shapes_do_not_broadcast_name_the_site(prior, score, error, said):
    """Regression: a prior's or score's parameter of a shape that does not broadcast
    against the table gave JAX's bare broadcasting error; it now names the edge site and
    the prior or score (JAX's message follows, in its release's words)."""
    H, n, d = 2, 5, 3
    X = jnp.ones((H, n, d))

    def model(X):
        with numpyro.plate("h", H, dim=-2), numpyro.plate("q", n, dim=-1):
            j = si.edge("phi", prior(n, X), score(X))
            numpyro.deterministic("out", j * 1.0)

    with pytest.raises(error, match=f"edge site 'phi': {said}"):
        si.expectation(model, "out", X)


def test_complex_features_and_values_are_refused_by_name():
    """Regression: complex queries, keys or values lost their imaginary part with only a
    warning (JAX's, about casting complex to real); they are refused, naming the argument
    (a score's features, a prior's parameter) or the value site."""
    qc = XQ + 1j * XQ
    with pytest.raises(TypeError, match="Dot: child features is complex.*expected a real"):
        si.scores.Dot(qc, XK)
    with pytest.raises(TypeError, match="Dot: parent features .*complex"):
        si.scores.Dot(XQ, XK.astype(np.complex64))
    with pytest.raises(TypeError, match="RelativePosition bias .*complex"):
        si.priors.RelativePosition(np.zeros(2 * M - 1, np.complex64), M)

    def model(q, k, v):
        with numpyro.plate("queries", N):
            j = si.edge("phi", si.priors.Uniform(M), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j])

    vc = jnp.asarray(V + 1j * V)
    for run in (lambda *a: si.expectation(model, "out", *a),
                si.attention(model, "out"), si.attention(model, "out", "blocked")):
        with pytest.raises(TypeError, match="Dot: child features is complex"):
            run(qc, XK, V)
        with pytest.raises(TypeError, match="value site 'out' is complex64: expected a real"):
            run(XQ, XK, vc)


def test_linear_gaussian_offset_and_precision_of_the_wrong_shape():
    """Regression: a LinearGaussian ``b`` or ``precision`` of the wrong shape gave JAX's
    bare broadcasting error when the table was built; the score refuses it, naming the
    argument and the shapes it takes (d_x = 3 features, 4 parents)."""
    x, z, A = np.ones((N, 3)), np.ones((4, 2)), np.ones((3, 2))
    for b in (np.ones(2), np.ones((3, 3)), np.ones((4, 2))):
        with pytest.raises(ValueError, match=r"LinearGaussian: b has shape .*, expected "
                                             r"\(d_x,\) = \(3,\) or \(parents, d_x\) = \(4, 3\)"):
            si.scores.LinearGaussian(x, z, A, b=b)
    for prec in (np.ones(2), np.ones((3, 3)), np.ones((6, 1, 3))):
        with pytest.raises(ValueError, match=r"LinearGaussian: precision has shape .*, "
                                             r"expected a scalar, a diagonal \(d_x,\) = \(3,\), "
                                             r"or one broadcasting against \(children, "
                                             r"parents, d_x\) = \(5, 4, 3\)"):
            si.scores.LinearGaussian(x, z, A, precision=prec)
    # the shapes it takes (what broadcasts to them too, and batch dims on b and precision)
    for b in (np.ones(3), np.ones((4, 3)), np.ones((2, 4, 3)), np.ones(())):
        assert si.scores.LinearGaussian(x, z, A, b=b, precision=np.ones(3)).dense().shape[-2:] \
            == (N, 4)
    for prec in (np.ones((4, 3)), np.ones((1, 3)), np.ones((2, 1, 1, 3))):
        assert si.scores.LinearGaussian(x, z, A, precision=prec).dense().shape[-2:] == (N, 4)
    # traced (under jit) the shape check still runs: shapes are static
    with pytest.raises(ValueError, match="LinearGaussian: precision has shape"):
        jax.jit(lambda p: si.scores.LinearGaussian(x, z, A, precision=p).dense())(jnp.ones(2))


def test_a_score_that_depends_on_another_enumerated_site_names_the_cause():
    """A mixture over temperatures (an enumerated site feeding an edge's score) is not
    supported; the error said only "add a plate", now it names the likely cause."""
    q = k = jnp.ones((4, 2))
    temps = jnp.array([0.5, 3.0])

    def model(q, k):
        z = numpyro.sample("z", dist.Categorical(probs=jnp.array([0.3, 0.7])),
                           infer={"enumerate": "parallel"})
        with numpyro.plate("queries", 4):
            si.edge("phi", si.priors.Uniform(4), si.scores.Dot(q, k, scale=temps[z][..., None]))

    with pytest.raises(ValueError, match="edge site 'phi'.*another enumerated site"):
        si.log_marginal(model, q, k)


# --------------------------------------- value checks on traced arguments (jit, attention)


def _edge_model(prior, score):
    """One edge whose prior and score are built from the model's argument ``a``."""
    def model(a):
        with numpyro.plate("queries", N):
            j = si.edge("phi", prior(a), score(a))
            numpyro.deterministic("out", jnp.asarray(V)[j])

    return model


def _markov_model(log_transition, log_initial):
    """A chain of T = 4 Markov edges over K = 3 states, its prior built from ``a``."""
    emission = jnp.asarray(r.normal(size=(4, 3)))

    def model(a):
        prior = si.priors.Markov(log_transition(a), log_initial(a))

        def step(previous, e):
            z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("out", jnp.sin(1.0 + z))
            return z, None

        scan(step, jnp.asarray(-1), emission)

    return model


_S, _P = si.scores, si.priors
_UNIFORM, _DOT = (lambda a: _P.Uniform(M)), (lambda a: _S.Dot(XQ, XK))
_LT = np.log(np.full((3, 3), 1 / 3))

#: every value check of a score or prior: (model of the checked argument, a bad value)
_VALUE_CHECKS = {
    "NegSqDist scalar precision": (_edge_model(_UNIFORM, lambda a: _S.NegSqDist(XQ, XK, a)),
                                   -1.0),
    "NegSqDist diagonal precision": (
        _edge_model(_UNIFORM, lambda a: _S.NegSqDist(XQ, XK, a)), [1.0, -1.0, 1.0]),
    "NegSqDist full precision": (
        _edge_model(_UNIFORM, lambda a: _S.NegSqDist(XQ, XK, a)), np.diag([1.0, -1.0, 1.0])),
    "NegSqDist per-parent full precision": (
        _edge_model(_UNIFORM, lambda a: _S.NegSqDist(XQ, XK, a, precision_kind="parent_full")),
        np.stack([np.eye(D)] * (M - 1) + [-np.eye(D)])),
    "NegLogDist p": (_edge_model(_UNIFORM, lambda a: _S.NegLogDist(XQ, XK, p=a)), -1.0),
    "NegLogDist eps": (_edge_model(_UNIFORM, lambda a: _S.NegLogDist(XQ, XK, eps=a)), 0.0),
    "InvDist p": (_edge_model(_UNIFORM, lambda a: _S.InvDist(XQ, XK, p=a)), 0.0),
    "InvDist eps": (_edge_model(_UNIFORM, lambda a: _S.InvDist(XQ, XK, eps=a)), -1.0),
    "GaussianKernel sigma": (_edge_model(_UNIFORM, lambda a: _S.GaussianKernel(XQ, XK, a)),
                             0.0),
    "Cosine eps": (_edge_model(_UNIFORM, lambda a: _S.Cosine(XQ, XK, eps=a)), -1e-3),
    "LinearGaussian precision": (
        _edge_model(_UNIFORM, lambda a: _S.LinearGaussian(XQ, XK, np.eye(D), precision=a)),
        [1.0, 0.0, 1.0]),
    "Geometric q": (_edge_model(lambda a: _P.Geometric(a, M, offset=M - N), _DOT), 1.5),
    "Geometric q per child": (_edge_model(lambda a: _P.Geometric(a, M, offset=M - N), _DOT),
                              [0.3, 0.3, np.nan, 0.3, 0.3]),
    "Categorical logits row": (_edge_model(lambda a: _P.Categorical(a), _DOT),
                               [0.0, np.nan] + [0.0] * (M - 2)),
    "Categorical logits table": (_edge_model(lambda a: _P.Categorical(a), _DOT),
                                 np.where(np.eye(N, M) > 0, np.inf, 0.0)),
    "Markov log_transition": (_markov_model(lambda a: a, lambda a: np.zeros(3)),
                              np.where(np.eye(3) > 0, np.nan, _LT)),
    "Markov log_transition row": (_markov_model(lambda a: a, lambda a: np.zeros(3)),
                                  np.where(np.arange(3)[:, None] == 1, -np.inf, _LT)),
    "Markov log_initial": (_markov_model(lambda a: _LT, lambda a: a), [0.0, np.inf, 0.0]),
}


@pytest.mark.parametrize("case", list(_VALUE_CHECKS))
def test_value_checks_of_traced_arguments(case):
    """Every value check of a score's or prior's argument holds when the argument is a
    model argument, which `si.attention` traces under its own jit: called eagerly, it
    raises the exact engine's error (naming the argument), and under an outer jit both
    engines answer NaN, never the formula's finite number (a negative precision, a
    geometric q outside (0, 1), ... gave one)."""
    model, bad = _VALUE_CHECKS[case]
    bad = np.asarray(bad, np.float32)
    with pytest.raises(ValueError) as exact:
        si.expectation(model, "out", bad)
    with pytest.raises(ValueError) as lowered:
        si.attention(model, "out")(bad)
    assert str(lowered.value) == str(exact.value)
    for out in (jax.jit(si.attention(model, "out"))(bad),
                jax.jit(lambda a: si.expectation(model, "out", a))(bad)):  # noqa: B023
        assert np.all(np.isnan(np.asarray(out))), (case, out)


@pytest.mark.parametrize("case", ["GaussianKernel sigma", "Geometric q", "NegLogDist p"])
def test_a_traced_bad_argument_has_a_nan_gradient(case):
    """Regression: the NaN written for a bad traced argument was selected in, so its
    gradient was a finite 0 (an optimiser would read it); it is NaN now."""
    model, bad = _VALUE_CHECKS[case]
    bad = jnp.asarray(bad, jnp.float32)
    for run in (si.attention(model, "out"), lambda a: si.expectation(model, "out", a)):
        g = jax.jit(jax.grad(lambda a: jnp.sum(run(a))))(bad)  # noqa: B023
        assert np.all(np.isnan(np.asarray(g))), (case, g)


def test_an_edge_hidden_by_block_is_named():
    """Regression: ``numpyro.handlers.block(model, hide=["phi"])`` around an edge reached
    the engine as NumPyro's bare ``AssertionError`` (no PRNG key): the engine cannot see
    (so cannot enumerate) a hidden edge. The error names the site and the handler."""
    def model():
        with numpyro.plate("queries", N):
            j = si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))
            numpyro.deterministic("out", jnp.asarray(V)[j])

    hidden = numpyro.handlers.block(model, hide=["phi"])
    said = "edge site 'phi' is hidden from the engine by a block handler"
    for run in (lambda: si.log_marginal(hidden), lambda: si.marginals(hidden),
                lambda: si.attention(hidden, "out")(),
                lambda: jax.jit(lambda: si.log_marginal(hidden))()):
        with pytest.raises(ValueError, match=said):
            run()
    # hiding another site, or the edge from a seeded run's trace, is as before
    seeded = numpyro.handlers.block(numpyro.handlers.seed(model, 0), hide=["phi"])
    assert "phi" not in numpyro.handlers.trace(seeded).get_trace()
    with pytest.raises(ValueError, match="edge site 'phi' was drawn .* no PRNG key"):
        model()  # no seed at all: named (was NumPyro's bare AssertionError)


@pytest.mark.parametrize("form", ["hide", "hide_fn", "expose", "all"])
@pytest.mark.parametrize("seeded", [False, True])
def test_an_edge_hidden_by_any_form_of_block_is_named(form, seeded):
    """Regression: only ``block(hide=[...])`` was caught. ``block(hide_fn=...)`` on sample
    sites, ``block(expose=[...])`` and ``block()`` hid the edge from the engine too, which
    then raised a bare AssertionError or, under ``numpyro.handlers.seed``, returned the
    joint at a random structure as log Z. Every form is now refused, naming the site."""
    kw = {"hide": dict(hide=["phi"]), "hide_fn": dict(hide_fn=lambda m: m["type"] == "sample"),
          "expose": dict(expose=["out"]), "all": {}}[form]

    def edge():
        with numpyro.plate("queries", N):  # inside the block, which would hide it too
            return si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))

    def model():
        j = numpyro.handlers.block(edge, **kw)()
        numpyro.deterministic("out", jnp.asarray(V)[j])

    said = "edge site 'phi' is hidden from the engine by a block handler"
    for run in (lambda: si.log_marginal(model), lambda: si.marginals(model),
                lambda: si.attention(model, "out")()):
        with pytest.raises(ValueError, match=said):
            if seeded:
                with numpyro.handlers.seed(rng_seed=0):
                    run()
            else:
                run()
    # outside the engine the check does not fire: NumPyro samples the edge (seeded inside
    # the block: an older NumPyro's block hides the site from a seed outside it too)
    numpyro.handlers.block(numpyro.handlers.seed(edge, 0), **kw)()


def test_an_eager_edge_reads_its_score_on_the_host_once(monkeypatch):
    """Regression: an eager edge copied its score table to the host twice (once for NaN /
    +inf entries, once for children left no parent). One copy of the edge's table gives
    both checks; each error is still raised (counted: ``np.asarray`` of JAX arrays)."""
    array_type = type(jnp.zeros(()))
    real = np.asarray
    reads = []

    def counting(a, *args, **kwargs):
        if isinstance(a, array_type) and a.ndim >= 2:
            reads.append(a.shape)
        return real(a, *args, **kwargs)

    def model(s):
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Uniform(M), si.scores.Custom(s))

    s = jnp.asarray(XQ @ XK.T)
    run = lambda s: numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(s)  # noqa: E731
    monkeypatch.setattr(np, "asarray", counting)
    run(s)
    # the prior's table once (its own empty rows, in log_table), the edge's table once
    assert reads == [(N, M), (N, M)]
    for bad, said in ((s.at[2, 4].set(jnp.nan), r"score contains NaN at index \(2, 4\)"),
                      (s.at[2, 4].set(jnp.inf), r"score contains inf at index \(2, 4\)"),
                      (s.at[3].set(-jnp.inf), "the score allows no parent for child 3")):
        with pytest.raises(ValueError, match=f"edge site 'phi': {said}"):
            run(bad)


def _scan_model(where):
    """Attention edges over the steps of a ``scan``, hidden by a ``block`` ``where``: around
    the edge inside the step, around the step function, or around the whole scan."""
    steps = 3
    qs = jnp.stack([jnp.asarray(XQ) * (t + 1) for t in range(steps)])

    def model():
        def step(c, q):
            with numpyro.plate("queries", N):
                def e():
                    return si.edge("phi", si.priors.Uniform(M), si.scores.Dot(q, XK))

                j = numpyro.handlers.block(e, hide=["phi"])() if where == "edge" else e()
                numpyro.deterministic("out", jnp.asarray(V)[j])
            return c, None

        body = numpyro.handlers.block(step, hide=["phi"]) if where == "step" else step
        run = functools.partial(scan, body, jnp.zeros(()), qs)
        numpyro.handlers.block(run, hide=["phi"])() if where == "scan" else run()

    return model


@pytest.mark.parametrize("where", ["edge", "step", "scan"])
def test_an_edge_hidden_by_block_in_a_scan_is_named(where):
    """A scan's steps run hidden from the engine and are replayed to it afterwards, so the
    check of a hidden edge was exempt inside a step. A block around the edge or the step
    function was refused all the same; one around the whole scan hid the replayed edges:
    the log-marginal came out of the edges' row normalisers alone, and the expectation
    raised an unrelated error about a leftover tensor dim. Every placement is refused,
    naming the site, eagerly and under jit; without the block the scan runs."""
    said = "edge site 'phi' is hidden from the engine by a block handler"
    model = _scan_model(where)
    for run in (lambda: si.log_marginal(model), lambda: si.marginals(model),
                lambda: si.expectation(model, "out"), lambda: si.attention(model, "out")(),
                lambda: jax.jit(lambda: si.log_marginal(model))()):
        with pytest.raises(ValueError, match=said):
            run()
    unblocked = _scan_model("none")
    s = np.stack([(XQ * (t + 1)) @ XK.T for t in range(3)])
    np.testing.assert_allclose(si.log_marginal(unblocked),
                               (np.logaddexp.reduce(s, -1) - np.log(M)).sum(), rtol=1e-5)


def test_an_edge_in_a_cond_branch_is_refused_naming_cond():
    """An edge inside a ``numpyro.contrib.control_flow.cond`` branch: NumPyro runs the
    branches hidden from the handlers and cannot enumerate their sites, so the engine
    cannot sum the edge out. It was refused as hidden "by a block handler", which the
    model has none of; the error now names cond and says how to write the choice as data
    (a ``jnp.where`` of the two branches' scores), which the engine runs."""
    from numpyro.contrib.control_flow import cond

    def model(flag):
        def branch(sign):
            def run(_):
                with numpyro.plate("queries", N):
                    j = si.edge("phi", si.priors.Uniform(M), si.scores.Dot(sign * XQ, XK))
                return jnp.asarray(V)[j]
            return run

        numpyro.deterministic("out", cond(flag, branch(1.0), branch(-1.0), None))

    said = (r"edge site 'phi' is inside a branch of numpyro.contrib.control_flow.cond.*"
            r"jnp.where")
    for run in (lambda: si.log_marginal(model, True), lambda: si.marginals(model, True),
                lambda: si.expectation(model, "out", True),
                lambda: si.attention(model, "out")(True),
                lambda: jax.jit(lambda f: si.log_marginal(model, f))(True)):
        with pytest.raises(ValueError, match=said):
            run()

    def as_data(flag):  # the suggested rewrite: one edge, the score chosen by the flag
        with numpyro.plate("queries", N):
            s = jnp.where(flag, XQ @ XK.T, -XQ @ XK.T)
            j = si.edge("phi", si.priors.Uniform(M), si.scores.Custom(s))
            numpyro.deterministic("out", jnp.asarray(V)[j])

    np.testing.assert_allclose(si.log_marginal(as_data, False),
                               (np.logaddexp.reduce(-XQ @ XK.T, -1) - np.log(M)).sum(),
                               rtol=1e-5)


def test_a_hop_past_the_nodes_is_refused_or_nan_under_numpyros_own_contraction():
    """``edge(..., child=a)`` reads row ``a`` of its ``(children, parents)`` table: a previous
    hop with more parents (5) than this edge has children (3) would read a clamped row, a
    finite wrong log-density in NumPyro's own ``log_density`` (the exact engine's bounds
    check refuses it). Eagerly the site is named; under ``jit`` the density is NaN."""
    from numpyro.contrib.funsor import enum, log_density

    scores = jnp.asarray(r.normal(size=(3, 5)))

    def model(s):
        with numpyro.plate("nodes", 3):
            a = si.edge("hop1", si.priors.Uniform(5), s)
            si.edge("hop2", si.priors.Uniform(5), s, child=a)

    def numpyros(s):
        return log_density(enum(model, first_available_dim=-2), (s,), {}, {})[0]

    with pytest.raises(ValueError, match=r"edge site 'hop2': child= takes the value 3, but the edge has 3 children"):
        numpyros(scores)
    assert jnp.isnan(jax.jit(numpyros)(scores))


def test_a_hop_to_a_node_with_no_parent_is_nan_under_jit():
    """A ``child=`` edge whose prior (or score) leaves node 1 no parent: eagerly the site is
    named; under ``jit`` every answer of the coupled model is NaN, as for any child left no
    parent. (The hop's row is read only at the node the previous hop reached, and carries
    no row normaliser: the empty row dropped the paths through node 1 and the answers were
    finite.)"""
    scores = jnp.asarray(r.normal(size=(3, 3)))
    keep = jnp.ones((3, 3), bool).at[1].set(False)

    def model(s, keep, forbid_by_score):
        with numpyro.plate("nodes", 3):
            a = si.edge("hop1", si.priors.Uniform(3), s)
            if forbid_by_score:
                b = si.edge("hop2", si.priors.Uniform(3), jnp.where(keep, s, -jnp.inf), child=a)
            else:
                b = si.edge("hop2", si.priors.Restricted(keep), s, child=a)
            numpyro.deterministic("out", jnp.asarray(V[:3])[b])

    for by_score in (False, True):
        with pytest.raises(ValueError, match="edge site 'hop2': .*allows no parent for child 1"):
            si.log_marginal(model, scores, keep, by_score)
        answers = jax.jit(lambda *a: (si.log_marginal(model, *a, by_score),
                                      si.marginals(model, *a, by_score),
                                      si.expectation(model, "out", *a, by_score)))(scores, keep)
        assert all(np.isnan(x).all() for x in jax.tree.leaves(answers)), answers


def test_an_observed_python_list_is_named():
    """Regression: ``obs=`` a Python list (a plausible slip: data typed as a list) failed
    deep in JAX's dtype lattice, 'Cannot determine dtype of [...]', from the model check
    that every entry point (`si.log_marginal`, `si.infer.nuts`, ...) runs first."""

    def model(y):
        with numpyro.plate("children", len(y)):
            phi = si.edge("phi", si.priors.Uniform(3))
            numpyro.sample("y", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[phi], 1.0), obs=y)

    with pytest.raises(TypeError, match=r"site 'y': its observed value is a list, not an array"):
        si.log_marginal(model, [-1.0, 0.1, 0.9])


@pytest.mark.parametrize("key", [0, np.uint32(7), None])
def test_sample_edges_names_a_key_that_is_not_one(key):
    """Regression: ``si.sample_edges(0, model, ...)`` (a seed where the key goes) failed
    inside JAX, 'invalid PRNG key data ... Got 0'; `si.infer.nuts` and `svi` name it."""

    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))

    with pytest.raises(TypeError, match=r"sample_edges: rng_key must be one PRNG key"):
        si.sample_edges(key, model)
    keys = jax.random.split(jax.random.key(0), 3)
    with pytest.raises(TypeError, match=r"sample_edges: rng_key must be one PRNG key"):
        si.sample_edges(keys, model)  # several keys: jax.vmap over them
    assert jax.vmap(lambda k: si.sample_edges(k, model)["phi"])(keys).shape == (3, N)


def test_sample_edges_takes_every_key_jax_takes():
    """Regression: a raw key as a NumPy ``uint32[2]`` array (which ``jax.random`` takes:
    a key saved with ``np.asarray``) was refused as "not one PRNG key"; it draws what the
    same key as a JAX array draws."""

    def model():
        with numpyro.plate("queries", N):
            si.edge("phi", si.priors.Uniform(M), si.scores.Dot(XQ, XK))

    raw = jax.random.PRNGKey(3)
    want = si.sample_edges(raw, model)["phi"]
    for key in (np.asarray(raw), np.array([0, 3], np.uint32)):
        np.testing.assert_array_equal(si.sample_edges(key, model)["phi"], want)
    with pytest.raises(TypeError, match=r"sample_edges: rng_key must be one PRNG key"):
        si.sample_edges(np.array([0, 3], np.int64), model)  # not a key's dtype


def test_a_value_indexed_out_of_its_plate_is_not_called_independent_of_the_edges():
    """Regression: ``si.gather(v, j)[0]`` recorded outside the plate (child 0's value, one
    would think; under enumeration the index takes the first enumerated value) was
    called "does not depend on any edge site", though it is read from one; the error
    says its leading dims are gone and how to record such a value."""
    s = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)))
    v = jnp.arange(4.0)

    def model(s):
        with numpyro.plate("i", 3):
            j = si.edge("phi", si.priors.Uniform(4), s)
        numpyro.deterministic("out", si.gather(v, j)[0])

    with pytest.raises(ValueError) as err:
        si.expectation(model, "out", s)
    msg = str(err.value)
    assert "deterministic site 'out'" in msg and "an index, sum or reshape" in msg, msg
    assert "Record a value read from an edge inside the plate" in msg, msg


def test_pointwise_log_likelihood_params_not_a_mapping():
    """Forgetting ``params`` (the model's arguments passed in its place) names it."""
    from structinfer.exact import likelihood_structure, pointwise_log_likelihood

    def model(q, k, x):
        with numpyro.plate("queries", q.shape[0]):
            j = si.edge("phi", si.priors.Uniform(k.shape[0]), si.scores.Dot(q, k))
            numpyro.sample("x", dist.Normal(jnp.arange(k.shape[0])[j], 1.0), obs=x)

    with pytest.raises(TypeError, match=r"pointwise_log_likelihood: params must be a mapping"):
        pointwise_log_likelihood(model, XQ, XK, np.zeros(N))
    with pytest.raises(TypeError, match=r"likelihood_structure: params must be a mapping"):
        likelihood_structure(model, XQ, XK, np.zeros(N))


def test_log_z_underflow_is_not_called_impossible():
    """A score and a likelihood that disagree by more than float32's exponent range about
    one edge site: the log-space contraction shifts their sum jointly and answers the
    float64 log Z (it answered -inf, then this error). Where the contraction is a real
    product of factors over two sites whose broadcast is above the joint shift's budget
    (the product of two steps of a Markov chain of K states broadcasts to K^3 elements:
    K = 102 is the smallest above `JOINT_MAX_ELEMENTS` = 2^20; a chain of 8 states
    answered this error before the budget) it keeps per-operand shifts and the sum can
    still underflow to log Z = -inf; the most probable structure is finite, so the error
    says the sum underflowed (not that no structure is possible)."""
    from structinfer.exact._log_einsum import JOINT_MAX_ELEMENTS, JOINT_MAX_RATIO

    def model(x, mu, s):
        with numpyro.plate("points", x.shape[0]):
            j = si.edge("z", si.priors.Uniform(mu.shape[0]), s)
            numpyro.sample("x", dist.Normal(mu[j], 1.0), obs=x)

    x, mu = jnp.zeros(2), jnp.array([0.0, 14.2])
    s = jnp.array([[0.0, 101.0], [0.0, 0.0]], jnp.float32)
    logits = (np.float64(s) - np.log(2) - 0.5 * np.log(2 * np.pi)
              - 0.5 * (0.0 - np.float64(mu)) ** 2)
    ref = np.logaddexp(logits[:, 0], logits[:, 1])
    np.testing.assert_allclose(si.log_marginal(model, x, mu, s), ref.sum(), atol=3e-5)  # eps * 101
    np.testing.assert_allclose(si.marginals(model, x, mu, s)["z"],
                               np.exp(logits - ref[:, None]), atol=1e-6)

    # step 1's score favours state 0 by 101 nats, step 2's potential the others
    K, T = int(JOINT_MAX_ELEMENTS ** (1 / 3)) + 1, 3
    assert K**3 > max(JOINT_MAX_ELEMENTS, JOINT_MAX_RATIO * K**2)  # above the budget
    em = np.zeros((T, K), np.float32)
    em[1, 0] = 101.0
    pot = np.zeros((T, K, K), np.float32)
    pot[2, 0, :] = -101.0
    log_t = np.full((K, K), -np.log(K), np.float32)

    def chain(em, pot):
        prior = si.priors.Markov(log_t, log_t[0])

        def step(previous, xs):
            e, f = xs
            z = si.edge("z", prior, e, previous=previous)
            si.primitives.potential("f", f[jnp.maximum(previous, 0), z])
            return z, None

        scan(step, jnp.asarray(-1), (em, pot))

    for f in (si.marginals, si.log_marginal):  # log_marginal answered -inf silently
        with pytest.raises(ValueError, match=r"model 'chain': log Z underflowed to -inf .* "
                                             r"most probable structure has log-weight -\d"):
            f(chain, em, pot)

    def impossible(s):  # no structure is possible: log_marginal still answers -inf
        with numpyro.plate("points", 2):
            j = si.edge("z", si.priors.Uniform(2), s)
            numpyro.factor("f", jnp.where(j == 0, -jnp.inf, jnp.where(j == 1, -jnp.inf, 0.0)))

    assert float(si.log_marginal(impossible, jnp.zeros((2, 2)))) == -np.inf
