"""structinfer.diagnostics (and the fits it reads) against brute force written here.

* the pointwise log-likelihood against a per-child logsumexp over parents;
* NUTS (edges collapsed) against the posterior of the geometric q on a grid, SVI's
  guide against the same;
* the InferenceData groups against the same formulas at the draws, and ArviZ's own
  functions (loo, compare, loo_pit, plot_energy, plot_ppc_dist, plot_khat) on it;
* the edge-posterior summaries against plain loops;
* PSIS-LOO warnings and comparison tables on constructed log-likelihoods.

Sizes are distinct primes: 7 or 11 children, 3 dims, 2 batch elements, 5 slots.
"""

import re
import warnings

import arviz_base as azb
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import tilt_model
from numpyro.ops.indexing import Vindex
from scipy.special import logsumexp, softmax
from scipy.stats import beta as beta_dist
from scipy.stats import norm

import structinfer as si
from structinfer import diagnostics as dg
from structinfer.demo import make_task, recency_model

matplotlib.use("Agg")

D = 3


# ---------------------------------------------------------------------------------------
# brute force
# ---------------------------------------------------------------------------------------


def geometric_log_prior(n, q):
    """Child c (node c + 1) takes parent j <= c with prob. prop. to q (1-q)^(c - j); ``q`` a
    scalar, or an array of them (the tables stacked in front)."""
    q = np.asarray(q, np.float64)[..., None, None]
    c, j = np.arange(n)[:, None], np.arange(n)[None, :]
    lw = np.where(j <= c, np.log(q) + (c - j) * np.log1p(-q), -np.inf)
    return lw - logsumexp(lw, axis=-1, keepdims=True)


def gaussian_loglik(x, w, sigma):
    """ll[c, j] = log N(x_{c+1}; W x_j, sigma^2 I)."""
    x = np.asarray(x, np.float64)
    mu = x[:-1] @ np.asarray(w, np.float64).T
    return norm.logpdf(x[1:, None, :], mu[None, :, :], sigma).sum(-1)


def brute_pointwise(x, w, sigma, q):
    """Per-child log-likelihood, parents summed out by hand; ``q`` a scalar or an array."""
    n = x.shape[0] - 1
    return logsumexp(geometric_log_prior(n, q) + gaussian_loglik(x, w, sigma), axis=-1)


def q_model(x, w, sigma):
    """Geometric x Beta(2, 2) prior; W and sigma given, only q is sampled."""
    n = x.shape[0] - 1
    q = numpyro.sample("q", dist.Beta(2.0, 2.0))
    with numpyro.plate("children", n):
        phi = si.edge("phi", si.priors.Geometric(q, n, include_self=False, offset=1))
        mu = x[:-1] @ w.T
        numpyro.sample("x", dist.Normal(Vindex(mu)[..., phi, :], sigma).to_event(1), obs=x[1:])


# ---------------------------------------------------------------------------------------
# pointwise log-likelihood
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_pointwise_matches_per_child_logsumexp(precision, request):
    if precision == "float64":
        request.getfixturevalue("x64")
    task = make_task(12, dim=D, seed=3)  # 11 children
    dtype = jnp.float32 if precision == "float32" else jnp.float64
    x, w = jnp.asarray(task.x, dtype), jnp.asarray(task.weight, dtype)
    params = {"sigma": jnp.asarray(0.4, dtype), "q": jnp.asarray(0.3, dtype)}
    model = recency_model("geometric")
    ll = jax.jit(lambda p, x, w: si.exact.pointwise_log_likelihood(model, p, x, w))(params, x, w)
    ref = brute_pointwise(task.x, task.weight, 0.4, 0.3)
    assert ll.shape == (11,) and ll.dtype == dtype
    tol = 2e-4 if precision == "float32" else 1e-10
    np.testing.assert_allclose(ll, ref, rtol=tol, atol=tol)
    # the terms add up to the engine's log Z minus the log prior of the parameters
    @jax.jit
    def log_lik(p, x, w):
        lz = si.log_marginal(numpyro.handlers.substitute(model, data=p), x, w)
        log_prior = dist.HalfNormal(1.0).log_prob(p["sigma"]) + dist.Beta(1.0, 1.0).log_prob(
            p["q"]
        )
        return lz - log_prior

    np.testing.assert_allclose(jnp.sum(ll), log_lik(params, x, w), rtol=tol, atol=tol * 10)
    s = si.exact.likelihood_structure(model, params, x, w)
    assert s.name == "x" and s.plates == ("children",) and s.shape == (11,)


def test_pointwise_batch_plate_and_two_local_sites():
    """(batch, children) entries; each child has an edge and a local mixture site."""
    B, n, m, K = 2, 5, 7, 3
    r = np.random.default_rng(0)
    parents = r.normal(size=(B, m, D)).astype(np.float32)
    y = r.normal(size=(B, n, D)).astype(np.float32)
    logits = r.normal(size=(B, n, m)).astype(np.float32)
    scales = np.array([0.5, 1.0, 2.0], np.float32)

    def model(parents, y):
        with numpyro.plate("batch", B, dim=-2), numpyro.plate("children", n, dim=-1):
            phi = si.edge("phi", si.priors.Categorical(logits))
            z = numpyro.sample("z", dist.Categorical(jnp.ones(K) / K),
                               infer={"enumerate": "parallel"})
            mu = Vindex(jnp.asarray(parents)[:, None])[..., phi, :]
            numpyro.sample("y", dist.Normal(mu, Vindex(jnp.asarray(scales))[z][..., None])
                           .to_event(1), obs=y)

    ll = jax.jit(lambda: si.exact.pointwise_log_likelihood(model, None, parents, y))()
    lp = logits - logsumexp(logits, -1, keepdims=True)
    ref = np.zeros((B, n))
    for b in range(B):
        for i in range(n):
            terms = [
                lp[b, i, j] - np.log(K) + norm.logpdf(y[b, i], parents[b, j], scales[k]).sum()
                for j in range(m)
                for k in range(K)
            ]
            ref[b, i] = logsumexp(terms)
    np.testing.assert_allclose(ll, ref, rtol=1e-4, atol=1e-4)
    s = si.exact.likelihood_structure(model, None, parents, y)
    assert s.plates == ("batch", "children") and s.shape == (B, n)


def attention_obs_model(xq, xk, v, y):
    """Attention over given keys with a score, and an observed value per query."""
    with numpyro.plate("queries", xq.shape[0]):
        phi = si.edge("phi", si.priors.Uniform(xk.shape[0]), si.scores.Dot(xq, xk))
        numpyro.sample("y", dist.Normal(Vindex(v)[..., phi, :], 0.5).to_event(1), obs=y)


def test_score_factors_refused_or_normalised():
    r = np.random.default_rng(1)
    n, m = 5, 7
    xq, xk = r.normal(size=(n, D)), r.normal(size=(m, D))
    v, y = r.normal(size=(m, 2)), r.normal(size=(n, 2))
    with pytest.raises(dg.EnergyOnlyModelError, match=r"'phi\.score'.*score_factors='normalize'"):
        si.exact.pointwise_log_likelihood(attention_obs_model, None, xq, xk, v, y)
    ll = jax.jit(
        lambda *a: si.exact.pointwise_log_likelihood(attention_obs_model, None, *a,
                                               score_factors="normalize")
    )(xq, xk, v, y)
    att = softmax(xq @ xk.T, -1)  # the conditional prior p(phi_i = j | inputs)
    lik = norm.logpdf(y[:, None, :], v[None], 0.5).sum(-1)
    np.testing.assert_allclose(ll, logsumexp(np.log(att) + lik, -1), rtol=1e-4, atol=1e-4)


def energy_only_model(xq, xk):
    with numpyro.plate("queries", xq.shape[0]):
        si.edge("phi", si.priors.Uniform(xk.shape[0]), si.scores.Dot(xq, xk))


def energy_with_param_model(xq, xk):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("queries", xq.shape[0]):
        si.edge("phi", si.priors.Uniform(xk.shape[0]), si.scores.Dot(s * xq, xk))


def test_energy_only_models_are_refused():
    r = np.random.default_rng(2)
    xq, xk = r.normal(size=(5, D)), r.normal(size=(7, D))
    with pytest.raises(dg.EnergyOnlyModelError, match="no observed sample site"):
        si.exact.pointwise_log_likelihood(energy_only_model, None, xq, xk)
    with pytest.raises(dg.EnergyOnlyModelError, match="energy_with_param_model"):
        dg.check_comparable(energy_with_param_model, xq, xk)  # shape-only: before fitting


def test_enumerated_site_coupling_children_is_refused():
    r = np.random.default_rng(3)
    y = r.normal(size=(5,))

    def model(y):
        z = numpyro.sample("z", dist.Categorical(jnp.ones(3) / 3), infer={"enumerate": "parallel"})
        with numpyro.plate("children", 5):
            numpyro.sample("y", dist.Normal(z.astype(y.dtype), 1.0), obs=y)

    with pytest.raises(ValueError, match="enumerated site 'z' lies outside"):
        si.exact.pointwise_log_likelihood(model, None, y)


# ---------------------------------------------------------------------------------------
# fitting: NUTS and SVI against the grid posterior of q
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q_task():
    task = make_task(12, dim=D, q=0.35, noise=0.3, seed=5)
    grid = np.linspace(1e-4, 1 - 1e-4, 4001)
    logp = brute_pointwise(task.x, task.weight, 0.3, grid).sum(-1)  # every grid point at once
    logp += beta_dist.logpdf(grid, 2.0, 2.0)
    p = np.exp(logp - logp.max())
    p /= p.sum()
    mean = float((grid * p).sum())
    sd = float(np.sqrt(((grid - mean) ** 2 * p).sum()))
    return task, mean, sd


@pytest.fixture(scope="module")
def q_fit(q_task):
    task = q_task[0]
    return si.infer.nuts(jax.random.PRNGKey(1), q_model, task.x, task.weight, 0.3,
                         num_warmup=300, num_samples=400, num_chains=2, progress_bar=False)


def test_nuts_matches_grid_posterior_of_q(q_task, q_fit):
    _, mean, sd = q_task
    q = np.asarray(q_fit.get_samples(group_by_chain=True)["q"])
    assert q.shape == (2, 400)
    # 800 draws (ESS of a few hundred): the error of the mean is ~0.06 sd; allow 0.3 sd.
    # A missing log-Jacobian of the logit transform would shift the mean by ~0.5 sd.
    assert abs(q.mean() - mean) < 0.3 * sd, (q.mean(), mean, sd)
    assert abs(q.std() - sd) < 0.2 * sd, (q.std(), sd)


def test_svi_guide_draws_in_the_inference_data(q_task):
    task, mean, sd = q_task
    fit = si.infer.svi(jax.random.PRNGKey(0), q_model, task.x, task.weight, 0.3,
                       optim=numpyro.optim.Adam(0.05), num_steps=400, progress_bar=False)
    losses = np.asarray(fit[1].losses)
    assert losses.shape == (400,) and np.mean(losses[-50:]) < np.mean(losses[:50])
    dt = dg.to_inference_data(fit, task.x, task.weight, 0.3, num_draws=300,
                              posterior_predictive=False)
    q = dt["posterior"]["q"].values
    assert q.shape == (1, 300) and dt.attrs["inference_method"] == "svi"
    assert dt["log_likelihood"]["x"].shape == (1, 300, 11)
    # a Gaussian guide on logit(q): the mean is close to the exact posterior mean
    assert abs(q.mean() - mean) < 0.5 * sd, (q.mean(), mean, sd)


def test_bad_fits_are_refused(q_task):
    task = q_task[0]
    with pytest.raises(TypeError, match=r"MCMC .* or an \(SVI, SVIRunResult\) pair"):
        dg.to_inference_data({"q": 1}, task.x, task.weight, 0.3)
    unrun = numpyro.infer.MCMC(si.infer.NUTS(q_model), num_warmup=1, num_samples=1)
    with pytest.raises(ValueError, match="no draws"):
        dg.to_inference_data(unrun, task.x, task.weight, 0.3)


@pytest.fixture(scope="module")
def small_svi_fit(q_task):
    task = q_task[0]
    return si.infer.svi(jax.random.PRNGKey(0), q_model, task.x, task.weight, 0.3,
                        num_steps=20, progress_bar=False)


@pytest.mark.parametrize("kw, match", [
    (dict(num_draws=0), "num_draws must be a positive int, got 0"),
    (dict(num_draws=-3), "num_draws must be a positive int, got -3"),
    (dict(num_draws=2.5), "num_draws must be a positive int, got 2.5"),
    (dict(num_prior_draws=-2), "num_prior_draws must be a non-negative int, got -2"),
    (dict(num_prior_draws=2.5), "num_prior_draws must be a non-negative int, got 2.5"),
    (dict(num_prior_draws=True), "num_prior_draws must be a non-negative int, got True"),
    (dict(batch_size=-1), "batch_size must be a positive int or None, got -1"),
    (dict(batch_size=0), "batch_size must be a positive int or None, got 0"),
])
def test_to_inference_data_refuses_bad_counts(q_task, small_svi_fit, kw, match):
    """Regression: bad counts gave an IndexError, an MLIRError or a reshape TypeError, or
    (a fractional num_prior_draws) were silently truncated."""
    task = q_task[0]
    with pytest.raises(ValueError, match=r"to_inference_data: " + re.escape(match)):
        dg.to_inference_data(small_svi_fit, task.x, task.weight, 0.3,
                             posterior_predictive=False, **kw)


@pytest.mark.parametrize("key", [0, np.uint32(3), "0"])
def test_to_inference_data_names_a_key_that_is_not_one(q_task, small_svi_fit, key):
    """Regression: ``rng_key=0`` (a seed) failed inside JAX, 'invalid PRNG key data'."""
    task = q_task[0]
    with pytest.raises(TypeError, match=r"to_inference_data: rng_key must be one PRNG key"):
        dg.to_inference_data(small_svi_fit, task.x, task.weight, 0.3, rng_key=key)


def test_to_inference_data_accepts_good_counts(q_task, small_svi_fit):
    task = q_task[0]
    dt = dg.to_inference_data(small_svi_fit, task.x, task.weight, 0.3, num_draws=7,
                              num_prior_draws=np.int64(3), batch_size=None,
                              posterior_predictive=False)
    assert dt["posterior"]["q"].shape == (1, 7) and dt["prior"]["q"].shape == (1, 3)


def test_the_data_must_be_the_fits_own(q_task, q_fit):
    """Regression: other data than the fit's gave a DataTree whose observed_data (the
    fit's) and log_likelihood (the caller's) described two datasets."""
    task = q_task[0]
    with pytest.raises(ValueError, match="'x'.*differ from the data the fit ran on"):
        dg.to_inference_data(q_fit, task.x + 1.0, task.weight, 0.3, posterior_predictive=False)
    # Regression: other covariates (arguments that are not observed) were not refused:
    # the log-likelihood of another model-data pair, finite and wrong. The MCMC keeps
    # the arguments it ran on; each one is compared, by its name in the signature.
    for args, name in (((task.x, 2 * task.weight, 0.3), "w"), ((task.x, task.weight, 0.31),
                                                                "sigma")):
        with pytest.raises(ValueError, match=rf"model argument\(s\) \['{name}'\] given here "
                           "differ from those the MCMC ran on"):
            dg.to_inference_data(q_fit, *args, posterior_predictive=False)
    dt = dg.to_inference_data(q_fit, task.x, np.asarray(task.weight), sigma=0.3,
                              posterior_predictive=False)
    assert "log_likelihood" in dt.children

    with pytest.raises(ValueError, match="true_edges.*'ph'.*edge sites.*'phi'"):
        dg.to_inference_data(q_fit, task.x, task.weight, 0.3, true_edges={"ph": task.parents},
                             posterior_predictive=False)


def test_a_log_argument_the_model_fills_is_not_data():
    """A list the model appends its traced values to holds tracers after the MCMC run: it
    is not data, and the fresh list given to to_inference_data is not refused."""
    y = jnp.array([-1.1, 0.9, 1.2])
    fit = si.infer.nuts(jax.random.PRNGKey(0), tilt_model, y, [], num_warmup=10, num_samples=10,
                        progress_bar=False)
    dt = dg.to_inference_data(fit, y, [], posterior_predictive=False)
    assert dt["log_likelihood"]["y"].shape == (1, 10, 3)
    with pytest.raises(ValueError, match=r"\['y'\] given here differ"):
        dg.to_inference_data(fit, jnp.array([0.3, 0.3, 0.3]), [], posterior_predictive=False)


def test_lp_is_the_log_density_of_the_draws(q_fit, q_idata):
    """Regression: ArviZ's `from_numpyro` stored NumPyro's potential energy (-log p) as
    `lp`; `lp` is the log density, +log p, of each draw."""
    pe = np.asarray(q_fit.get_extra_fields(group_by_chain=True)["potential_energy"])
    np.testing.assert_allclose(q_idata["sample_stats"]["lp"].values, -pe)


def test_loo_refuses_point_estimates(q_task):
    """A delta guide has no posterior spread: its "LOO" would be the in-sample fit."""
    task = q_task[0]
    fit = si.infer.svi(jax.random.PRNGKey(0), q_model, task.x, task.weight, 0.3, guide="delta",
                       optim=numpyro.optim.Adam(0.05), num_steps=50, progress_bar=False)
    dt = dg.to_inference_data(fit, task.x, task.weight, 0.3, num_draws=20,
                              posterior_predictive=False)
    with pytest.raises(ValueError, match="point estimate"):
        dg.loo(dt)


# ---------------------------------------------------------------------------------------
# InferenceData
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q_idata(q_task, q_fit):
    task = q_task[0]
    return dg.to_inference_data(q_fit, task.x, task.weight, 0.3, true_edges={"phi": task.parents},
                                posterior_predictive=False)


def test_inference_data_groups_match_brute_force(q_task, q_fit, q_idata):
    task = q_task[0]
    dt = q_idata
    assert {"posterior", "sample_stats", "log_likelihood", "observed_data", "constant_data",
            "edge_posterior"} <= set(dt.children)
    ll = dt["log_likelihood"]["x"]
    assert ll.dims == ("chain", "draw", "children") and ll.shape == (2, 400, 11)
    q = np.asarray(q_fit.get_samples(group_by_chain=True)["q"], np.float64)
    np.testing.assert_allclose(dt["posterior"]["q"].values, q)
    for c, s in [(0, 0), (1, 399), (1, 17)]:
        np.testing.assert_allclose(
            ll.values[c, s], brute_pointwise(task.x, task.weight, 0.3, q[c, s]), rtol=2e-4,
            atol=2e-4,
        )
    np.testing.assert_allclose(dt["observed_data"]["x"].values, task.x[1:])
    np.testing.assert_allclose(dt["constant_data"]["x"].values, task.x)
    assert {"energy", "diverging", "lp"} <= set(dt["sample_stats"].data_vars)
    # posterior edge marginals: the average over the draws of the exact conditional posterior
    lik = gaussian_loglik(task.x, task.weight, 0.3)
    ref = np.mean(softmax(geometric_log_prior(11, q.ravel()) + lik, -1), 0)
    ep = dt["edge_posterior"]
    np.testing.assert_allclose(ep["phi"].values, ref, atol=2e-4)
    np.testing.assert_array_equal(ep["phi_true"].values, task.parents)
    assert ep.attrs["phi.offset"] == 1
    prior_ref = np.mean(np.exp(geometric_log_prior(11, q.ravel())), 0)
    np.testing.assert_allclose(ep["phi_prior"].values, prior_ref, atol=2e-4)


def test_edge_summary_and_hyperparameters(q_task, q_idata):
    task = q_task[0]
    summ = dg.edge_summary(q_idata)
    a = q_idata["edge_posterior"]["phi"].values
    assert summ["map_accuracy"] == pytest.approx(np.mean(a.argmax(-1) == task.parents))
    assert summ["true_parent_prob"] == pytest.approx(a[np.arange(11), task.parents].mean(), rel=1e-5)
    table = dg.hyperparameter_summary(q_idata, ["q"])
    assert table.loc["q", "mean"] == pytest.approx(float(q_idata["posterior"]["q"].mean()), abs=1e-3)
    with pytest.raises(KeyError, match="'nope'") as err:
        dg.hyperparameter_summary(q_idata, ["nope"])
    # regression: KeyError's own str() quoted the sentence ('"hyperparameter_summary: ..."')
    assert str(err.value).startswith("hyperparameter_summary: ['nope'] not in"), str(err.value)
    for call, start in ((lambda: dg.edge_summary(q_idata, site="nope"), "edge_summary: "),
                        (lambda: dg.compare_edges({"a": q_idata}, site="nope"),
                         "compare_edges: model 'a': edge_summary: ")):
        with pytest.raises(KeyError) as err:
            call()
        assert str(err.value).startswith(start), str(err.value)


def test_loo_with_a_constant_child_keeps_arviz_reff(q_idata):
    """Where a child's log-likelihood is constant over the draws (the first child: one
    possible parent), `loo` builds PSIS weights itself; the other children's weights use
    ArviZ's default relative efficiency r_eff (the mean ESS over the draws), so their
    elpd_i equal ArviZ's own loo on them alone, on a 2-chain fit (r_eff sets the tail
    length Pareto smoothing fits)."""
    import arviz_stats as azs

    ll = q_idata["log_likelihood"]["x"].values.astype(np.float64)  # as `loo` weighs it
    const = np.ptp(ll, axis=(0, 1)) == 0
    assert const[0] and not const[1:].any()  # the path under test: one constant child
    post = {"q": q_idata["posterior"]["q"].values}
    rest = azb.from_dict({"posterior": post, "log_likelihood": {"x": ll[..., 1:]}},
                         dims={"x": ["children"]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = np.asarray(dg.loo(q_idata).elpd_i)
        theirs = np.asarray(azs.loo(rest, pointwise=True).elpd_i)
    np.testing.assert_allclose(ours[1:], theirs, rtol=1e-12)
    np.testing.assert_allclose(ours[0], ll[0, 0, 0], rtol=1e-12)  # exactly its likelihood


# ---------------------------------------------------------------------------------------
# LOO and comparison
# ---------------------------------------------------------------------------------------


def synthetic_idata(shift, outlier=None, seed=0, n=11):
    r = np.random.default_rng(seed)
    ll = -1.0 - shift + 0.1 * r.normal(size=(2, 200, n))
    if outlier is not None:  # one child whose likelihood has a heavy right tail
        ll[..., outlier] = -5.0 + 4.0 * r.standard_cauchy(size=(2, 200)).clip(-30, 30)
    return azb.from_dict(
        {"posterior": {"mu": r.normal(size=(2, 200))}, "log_likelihood": {"x": ll}},
        dims={"x": ["children"]},
    )


def test_loo_warns_with_the_badly_approximated_children():
    with pytest.warns(dg.ParetoKWarning, match=r"model 'bad'.*children 3 \(k="):
        res = dg.loo(synthetic_idata(0.0, outlier=3), name="bad")
    k = np.asarray(res.pareto_k)
    assert k[3] > res.good_k and (np.delete(k, 3) < res.good_k).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dg.ParetoKWarning)
        dg.loo(synthetic_idata(0.0), name="good")  # no warning for a well-behaved one


#: one child's log-likelihood over 60 draws (from a demo fit) that ties at PSIS's tail
#: cutoff, where ArviZ's smoothing gives NaN weights
TIED_AT_CUTOFF = [
    -4.0086, -4.0086, -4.0086, -4.2148, -4.2148, -4.2148, -4.2148, -3.8552, -4.6751,
    -4.6751, -5.0587, -5.0587, -5.0587, -5.0587, -3.7899, -3.7899, -3.7899, -3.5295,
    -3.2719, -4.7032, -4.4773, -3.6334, -4.4267, -4.6207, -4.6207, -4.6207, -4.6207,
    -4.6207, -4.6207, -4.6207, -4.6207, -4.6207, -4.6207, -4.6207, -4.611, -4.611, -3.6952,
    -5.7742, -5.7742, -5.7742, -5.6811, -3.4649, -6.1937, -3.6816, -3.59, -3.8789, -3.9145,
    -3.473, -3.5887, -3.8967, -6.3763, -6.3763, -4.252, -3.7955, -3.3258, -3.3337, -5.7697,
    -5.1198, -3.6956, -3.6409,
]


def test_loo_falls_back_to_truncated_importance_sampling_where_psis_fails():
    """Ties in the log-likelihood break ArviZ's Pareto smoothing: NaN weights when they
    straddle the tail's cutoff, an error when the whole tail ties. Those children's
    leave-one-out density is then truncated importance sampling (Ionides 2008), written
    here, with a warning naming them; the others keep ArviZ's PSIS. Never a NaN elpd."""
    import arviz_stats as azs

    r = np.random.default_rng(0)
    ll = -1.0 + 0.1 * r.normal(size=(1, 60, 4))
    ll[0, :, 1] = TIED_AT_CUTOFF
    ll[0, :, 2] = np.repeat([-3.0, -4.0, -5.0, -6.0], 15)  # the whole tail tied

    def idata(ll, dim="children"):
        return azb.from_dict({"posterior": {"mu": r.normal(size=ll.shape[:2])},
                              "log_likelihood": {"x": ll}}, dims={"x": [dim]})

    with pytest.warns(dg.ParetoKWarning, match=r"model 'tied'.*children 1, children 2.*truncated"):
        res = dg.loo(idata(ll), name="tied")
    with pytest.warns(dg.ParetoKWarning):  # a dim named as the fallback's own stacked dim
        assert float(dg.loo(idata(ll, "obs")).elpd) == pytest.approx(float(res.elpd))
    elpd_i = np.asarray(res.elpd_i)
    assert np.isfinite(elpd_i).all() and np.isfinite(res.elpd), elpd_i
    for i in (1, 2):  # w_s proportional to 1 / p(y_i | theta_s), capped at sqrt(S) mean(w)
        lw = -ll[0, :, i] - logsumexp(-ll[0, :, i])
        lw = np.minimum(lw, np.log(np.sqrt(60) / 60))
        lw -= logsumexp(lw)
        assert elpd_i[i] == pytest.approx(logsumexp(lw + ll[0, :, i]), rel=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        psis = np.asarray(azs.loo(idata(ll[..., [0, 3]]), pointwise=True).elpd_i)
    np.testing.assert_allclose(elpd_i[[0, 3]], psis, rtol=1e-9)


def test_compare_table_ranks_by_elpd():
    models = {"worse": synthetic_idata(0.5, seed=1), "better": synthetic_idata(0.0, seed=2)}
    table = dg.compare(models)
    assert list(table.index) == ["better", "worse"]
    assert table.loc["worse", "elpd_diff"] == pytest.approx(0.5 * 11, abs=0.3)
    with pytest.raises(ValueError, match="at least two"):
        dg.compare({"a": synthetic_idata(0.0)})
    with pytest.raises(ValueError, match="different numbers of observations"):
        dg.compare({"a": synthetic_idata(0.0), "b": synthetic_idata(0.0, n=7)})


def test_compare_refuses_models_of_different_observation_shapes():
    """Six observations as (2, 3) and as (6,): not the same data, a clear error (not
    NumPy's broadcasting error from inside ArviZ)."""
    r = np.random.default_rng(0)
    ll = -1.0 + 0.1 * r.normal(size=(2, 200, 6))
    grid = azb.from_dict({"posterior": {"mu": r.normal(size=(2, 200))},
                          "log_likelihood": {"x": ll.reshape(2, 200, 2, 3)}},
                         dims={"x": ["batch", "children"]})
    flat = azb.from_dict({"posterior": {"mu": r.normal(size=(2, 200))},
                          "log_likelihood": {"x": ll}}, dims={"x": ["children"]})
    with pytest.raises(ValueError, match=r"different observation shapes.*\(2, 3\).*\(6,\)"):
        dg.compare({"grid": grid, "flat": flat})


@pytest.mark.parametrize("draws", [3, 20, 24])
def test_loo_names_too_few_draws(draws):
    """PSIS fits a Pareto tail to the largest fifth of the draws and needs 5 of them:
    below 25 draws a clear error (it was NumPy's IndexError, or truncated importance
    sampling for every child with a warning blaming ties that were not there)."""
    ll = synthetic_idata(0.0)["log_likelihood"]["x"].values[:1, :draws]
    r = np.random.default_rng(1)
    idata = azb.from_dict({"posterior": {"mu": r.normal(size=(1, draws))},
                           "log_likelihood": {"x": ll}}, dims={"x": ["children"]})
    with pytest.raises(ValueError, match=rf"model 'few'.*at least 25 .*got {draws}"):
        dg.loo(idata, name="few")


@pytest.mark.parametrize("bad", [-np.inf, np.nan])
@pytest.mark.parametrize("everywhere", [False, True])
def test_loo_refuses_a_log_likelihood_that_is_not_finite(bad, everywhere):
    """A child whose likelihood is 0 (or NaN) at some draw has an infinite importance
    weight: PSIS-LOO cannot estimate its leave-one-out density. A clear error naming the
    model and the child, never a finite elpd (uniform weights ranked such a model first)
    nor a NaN one."""
    ll = synthetic_idata(0.0)["log_likelihood"]["x"].values.copy()
    if everywhere:
        ll[..., 4] = bad
    else:
        ll[0, 5, 4] = bad
    r = np.random.default_rng(1)
    idata = azb.from_dict({"posterior": {"mu": r.normal(size=(2, 200))},
                           "log_likelihood": {"x": ll}}, dims={"x": ["children"]})
    with pytest.raises(ValueError, match=r"model 'm'.*not finite.*children 4"):
        dg.loo(idata, name="m")
    with pytest.raises(ValueError, match=r"model 'm'.*children 4"):
        dg.compare({"ok": synthetic_idata(0.0), "m": idata})


def scalar_model(prior):
    """Seven scalar children, each copying one of five parents (means) plus noise of
    unknown scale s; every child's likelihood depends on s (so ArviZ's own PSIS applies)."""

    def model(y, mu):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("children", 7):
            phi = si.edge("phi", prior)
            numpyro.sample("y", dist.Normal(Vindex(mu)[phi], s), obs=y)

    return model


MU5 = np.array([-2.0, -1.0, 0.0, 1.0, 2.0], np.float32)
Y7 = (MU5[[0, 4, 1, 3, 2, 0, 4]] + 0.1 * np.random.default_rng(4).normal(size=7)).astype(
    np.float32)


@pytest.fixture(scope="module")
def scalar_idatas():
    out = {}
    for name, prior in (("uniform", si.priors.Uniform(5)),
                        ("peaked", si.priors.Categorical(jnp.log(jnp.array(
                            [0.6, 0.1, 0.1, 0.1, 0.1]))))):
        model = scalar_model(prior)
        mcmc = si.infer.nuts(jax.random.PRNGKey(2), model, Y7, MU5, num_warmup=100,
                             num_samples=200, progress_bar=False)
        out[name] = (mcmc, dg.to_inference_data(mcmc, Y7, MU5, rng_key=jax.random.PRNGKey(5)))
    return out


def test_arviz_functions_work_on_the_inference_data(scalar_idatas):
    import arviz_plots as azp
    import arviz_stats as azs
    import matplotlib.pyplot as plt

    mcmc, dt = scalar_idatas["uniform"]
    # the collapsed log-likelihood against a per-child sum over parents, at every draw
    s = np.asarray(mcmc.get_samples(group_by_chain=True)["s"], np.float64)
    ref = logsumexp(norm.logpdf(Y7[:, None], MU5[None, :], s[..., None, None]) - np.log(5), -1)
    np.testing.assert_allclose(dt["log_likelihood"]["y"].values, ref, rtol=1e-4, atol=1e-4)
    assert {"energy", "diverging"} <= set(dt["sample_stats"].data_vars)
    assert dt["posterior_predictive"]["y"].shape == (1, 200, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        elpd = azs.loo(dt, pointwise=True)
        assert np.isfinite(elpd.elpd) and np.isfinite(np.asarray(elpd.pareto_k)).all()
        table = azs.compare({n: idata for n, (_, idata) in scalar_idatas.items()})
        assert set(table.index) == {"uniform", "peaked"}
        pit = azs.loo_pit(dt)
        assert pit["y"].shape == (7,) and ((pit["y"] >= 0) & (pit["y"] <= 1)).all()
        azp.plot_energy(dt, backend="matplotlib")
        azp.plot_ppc_dist(dt, backend="matplotlib")
        azp.plot_khat(elpd, backend="matplotlib")
    plt.close("all")


def test_posterior_predictive_draws_edges_from_their_posterior(scalar_idatas):
    """With a small noise the replicated y_i sits at the mean of the parent drawn, so the
    frequencies of the drawn parents estimate p(phi_i = j | y), the edge_posterior group.
    (Parents drawn from the prior instead would be uniform.)"""
    _, dt = scalar_idatas["uniform"]
    rep = dt["posterior_predictive"]["y"].values.reshape(-1, 7)
    s = dt["posterior"]["s"].values.ravel()
    assert np.median(s) < 0.3
    nearest = np.abs(rep[..., None] - MU5).argmin(-1)  # (draws, children)
    freq = np.stack([np.bincount(nearest[:, i], minlength=5) for i in range(7)]) / len(rep)
    # nearest-mean classification errs where |noise| > 0.5: allow for it and MC error
    np.testing.assert_allclose(freq, dt["edge_posterior"]["phi"].values, atol=0.12)


# ---------------------------------------------------------------------------------------
# edge-posterior summaries against plain loops
# ---------------------------------------------------------------------------------------


def test_edge_statistics_against_loops():
    r = np.random.default_rng(7)
    n, m, offset = 5, 7, 2
    a = r.dirichlet(np.ones(m) * 0.5, size=(3, n))  # (batch 3, children, parents)
    a[0, 1] = np.eye(m)[4]  # a certain edge
    ent = dg.edge_entropy(a)
    d = np.arange(n)[:, None] + offset - np.arange(m)[None, :]
    for b in range(3):
        for i in range(n):
            p = a[b, i]
            h = -sum(pj * np.log(pj) for pj in p if pj > 0)
            assert ent[b, i] == pytest.approx(h, abs=1e-5)
            assert dg.effective_parents(a)[b, i] == pytest.approx(np.exp(h), rel=1e-5)
            assert dg.expected_distance(a, offset)[b, i] == pytest.approx((p * d[i]).sum(), abs=1e-5)
            for mass in (0.5, 0.9):
                w = 0
                while p[np.abs(d[i]) <= w].sum() < mass - 1e-9:
                    w += 1
                assert int(dg.effective_window(a, offset, mass)[b, i]) == w
    assert ent[0, 1] == pytest.approx(0.0, abs=1e-6)
    ds, probs = dg.distance_posterior(a, offset)
    for k, dd in enumerate(ds):
        assert probs[2, k] == pytest.approx((a[2] * (d == dd)).sum() / n, abs=1e-6)
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, atol=1e-6)
    true = r.integers(0, m, size=(3, n))
    agr = dg.edge_agreement(a, true)
    assert float(agr.accuracy) == pytest.approx(np.mean(a.argmax(-1) == true))
    assert float(agr.true_parent_prob) == pytest.approx(
        np.mean(np.take_along_axis(a, true[..., None], -1)), rel=1e-5)
    jitted = jax.jit(dg.edge_agreement)(jnp.asarray(a), jnp.asarray(true))
    assert float(jitted.accuracy) == pytest.approx(float(agr.accuracy))
    with pytest.raises(ValueError, match=r"shape \(3,\); expected one parent index per child"):
        dg.edge_agreement(a, np.zeros(3, int))
    with pytest.raises(ValueError, match="outside"):
        dg.edge_agreement(a, np.full((3, n), m))
    # Regression: under jit an index outside the parents gave finite numbers (-1 wrapped
    # to the last parent; `parents` counted the child as wrong). Now both are NaN.
    for bad in (-1, m):
        t = true.copy()
        t[1, 2] = bad
        out = jax.jit(dg.edge_agreement)(jnp.asarray(a), jnp.asarray(t))
        assert np.isnan(out.accuracy) and np.isnan(out.true_parent_prob), bad
        assert not bool(out.correct[1, 2])
        assert np.asarray(out.correct).sum() == np.asarray(jitted.correct).sum() - int(
            jitted.correct[1, 2])
    with pytest.raises(ValueError, match=r"shape \(3,\); expected one parent index per child"):
        jax.jit(dg.edge_agreement)(jnp.asarray(a), jnp.zeros(3, int))
    with pytest.raises(ValueError, match="mass must lie in"):
        dg.effective_window(a, mass=0.0)


def test_convergence_report():
    rep = dg.convergence_report(np.array([5.0, 3.0, 2.0, 2.0, 1.5]))
    assert rep.monotone and rep.num_iterations == 5 and rep.final == 1.5 and rep.first_increase == -1

    class Info(tuple):  # an info NamedTuple of an iterative algorithm (NaN after it stopped)
        _fields = ("energy", "num_steps")

        @property
        def energy(self):
            return self[0]

    rep = dg.convergence_report(Info((np.array([3.0, 2.0, 2.5, 1.0, np.nan, np.nan]), 3)))
    assert not rep.monotone and rep.first_increase == 1 and rep.max_increase == pytest.approx(0.5)
    assert rep.num_iterations == 4
    # a non-finite value before the last finite one is a step the descent did not take
    rep = dg.convergence_report(np.array([1.0, np.nan, 0.5, 0.4, np.nan]))
    assert not rep.monotone and rep.first_increase == 0 and rep.max_increase == np.inf
    assert rep.num_iterations == 4 and rep.final == 0.4
    with pytest.raises(ValueError, match="1-d"):
        dg.convergence_report(np.zeros((2, 3)))


@pytest.mark.parametrize("tol", [float("nan"), -1e-6, "1e-6", np.ones(2)])
def test_convergence_report_names_a_bad_tol(tol):
    """Regression: a NaN tol called a rising trace monotone (every ``inc > NaN`` is False),
    a negative one called a falling trace not monotone with ``max_increase`` 0; a string
    or an array failed inside NumPy. Each is now a ValueError naming tol."""
    with pytest.raises(ValueError, match="convergence_report: tol must be a non-negative"):
        dg.convergence_report(np.array([1.0, 2.0, 3.0]), tol=tol)
    for ok in (0, np.float32(1e-3), jnp.asarray(1e-3)):
        assert dg.convergence_report(np.array([3.0, 2.0]), tol=ok).monotone


def test_convergence_report_counts_a_nonfinite_stop_as_an_increase():
    """Regression: a run that stopped on a non-finite energy was reported monotone (its
    failing value was dropped as if it were the NaN padding after the run), and so was
    a trace ending in inf. The report reads `num_steps` from an `info` and keeps the
    failing value."""
    r = np.random.default_rng(0)
    x = np.round(r.normal(size=(20, 2)) * 10)  # duplicated points: a component collapses
    _, info = si.infer.gmm_em(x, x[:3], np.stack([np.eye(2)] * 3), raise_on_nonfinite=False)
    k = int(info.num_steps)
    assert bool(info.nonfinite) and k >= 2
    rep = dg.convergence_report(info)
    assert not rep.monotone and rep.max_increase == np.inf
    assert rep.first_increase == k - 1 and rep.num_iterations == k + 1
    assert not np.isfinite(rep.final)
    for last in (np.inf, -np.inf):
        rep = dg.convergence_report(np.array([3.0, 2.0, last]))
        assert not rep.monotone and rep.first_increase == 1 and rep.max_increase == np.inf
        assert rep.num_iterations == 3
    # a run that failed at its start (num_steps = 0, its one value non-finite) and a
    # one-value trace that is not finite: an increase, not a monotone descent (review)
    for start in (info._replace(num_steps=0, energy=np.full(3, np.nan)),
                  np.array([np.inf])):
        rep = dg.convergence_report(start)
        assert not rep.monotone and rep.max_increase == np.inf, rep
        assert rep.first_increase == 0 and rep.num_iterations == 1, rep
    # a finite run: the NaN after num_steps is padding
    _, ok = si.infer.gmm_em(x + r.normal(size=x.shape), x[:3], np.stack([np.eye(2)] * 3),
                            max_iters=500)
    rep = dg.convergence_report(ok)
    assert rep.monotone and rep.num_iterations == int(ok.num_steps) + 1


def test_convergence_report_max_increase_is_zero_when_the_trace_never_rises():
    """Regression: a decreasing trace reported its smallest decrease, negated, as
    `max_increase` (e.g. -1.0)."""
    for trace in ([5.0, 4.0, 3.0], [2.0, 2.0], [1.0]):
        rep = dg.convergence_report(np.array(trace))
        assert rep.monotone and rep.max_increase == 0.0 and rep.first_increase == -1
    assert dg.convergence_report(np.array([1.0, 1.5, 0.0])).max_increase == 0.5


# ---------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------


def test_plots(tmp_path, q_task, q_fit, q_idata):
    import matplotlib.pyplot as plt

    task = q_task[0]
    a = q_idata["edge_posterior"]["phi"].values
    ax = dg.plot_attention(a, true_edges=task.parents, title="geometric")
    np.testing.assert_allclose(ax.images[0].get_array(), a)
    ax = dg.plot_distance(a, q_idata["edge_posterior"]["phi_prior"].values, offset=1,
                          true_edges=task.parents)
    ds, post = dg.distance_posterior(a, 1)
    line = ax.lines[0]
    np.testing.assert_allclose(line.get_ydata(), np.asarray(post)[ds >= 0])
    ax = dg.plot_convergence({"em": [3.0, 2.0, 1.0], "bad": [3.0, 4.0, 1.0]})
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["em", "bad (non-monotone)"]
    dg.plot_hyperparameter(q_fit, "q", task.x, task.weight, 0.3, true_value=task.q)
    table = dg.compare({"a": synthetic_idata(0.0), "b": synthetic_idata(0.3, seed=4)})
    dg.plot_compare(table, path=tmp_path / "cmp.png")
    dg.plot_trace(q_idata, ["q"], path=tmp_path / "trace.png")
    assert (tmp_path / "cmp.png").stat().st_size > 0 and (tmp_path / "trace.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no prior group"):
        dg.plot_prior_posterior(q_idata, ["q"])
    plt.close("all")


def test_plot_distance_of_batched_marginals():
    """`(heads, children, parents)` marginals (the edge posterior of a batch plate): the
    mass by distance over every child of every head, computed here with loops (it raised
    NumPy's IndexError, indexing the heads with the distances' mask)."""
    import matplotlib.pyplot as plt

    r = np.random.default_rng(0)
    heads, n, m, offset = 2, 5, 7, 1
    a = r.dirichlet(np.ones(m), size=(heads, n))
    prior = r.dirichlet(np.ones(m), size=(heads, n))
    t = r.integers(0, m, size=(heads, n))
    ax = dg.plot_distance(a, prior, offset=offset, true_edges=t)
    ds = np.arange(-(m - 1) + offset, n - 1 + offset + 1)

    def by_distance(p):
        out = np.zeros(ds.size)
        for h in range(heads):
            for i in range(n):
                for j in range(m):
                    out[np.searchsorted(ds, i + offset - j)] += p[h, i, j] / (heads * n)
        return out

    post_line, prior_line = ax.lines[:2]
    np.testing.assert_allclose(post_line.get_xdata(), ds)  # negative distances have mass
    np.testing.assert_allclose(post_line.get_ydata(), by_distance(a), atol=1e-6)
    np.testing.assert_allclose(prior_line.get_ydata(), by_distance(prior), atol=1e-6)
    hist = [(np.arange(n) + offset - t == d).mean() for d in ds]
    np.testing.assert_allclose([b.get_height() for b in ax.patches], hist)
    with pytest.raises(ValueError, match=r"plot_distance: prior .*\(5, 6\).*\(5, 7\)"):
        dg.plot_distance(a, prior[..., :6] / prior[..., :6].sum(-1, keepdims=True))
    plt.close("all")


def test_one_variable_name_as_a_string():
    """`var_names="sigma"` is the variable sigma, as in ArviZ (it was read as the
    variables 's', 'i', 'g', 'm', 'a')."""
    import matplotlib.pyplot as plt

    r = np.random.default_rng(0)
    dt = azb.from_dict({"posterior": {"sigma": r.gamma(2.0, size=(2, 30)),
                                      "q": r.uniform(size=(2, 30))}})
    table = dg.hyperparameter_summary(dt, "sigma")
    assert list(table.index) == ["sigma"]
    assert table.loc["sigma", "mean"] == pytest.approx(dt["posterior"]["sigma"].values.mean())
    pc = dg.plot_trace(dt, "sigma")
    assert list(pc.viz["plot"].data_vars) == ["sigma"]
    plt.close("all")


def batched_q_model(x, w, sigma):
    """Two sequences (a batch plate) sharing one Geometric prior (one q, no batch dims)."""
    b, n = x.shape[0], x.shape[1] - 1
    q = numpyro.sample("q", dist.Beta(2.0, 2.0))
    with numpyro.plate("batch", b, dim=-2), numpyro.plate("children", n, dim=-1):
        phi = si.edge("phi", si.priors.Geometric(q, n, include_self=False, offset=1))
        mu = x[:, :-1] @ w.T
        numpyro.sample("x", dist.Normal(Vindex(mu[:, None])[..., phi, :], sigma).to_event(1),
                       obs=x[:, 1:])


@pytest.mark.parametrize("method", [pytest.param("nuts", marks=pytest.mark.exhaustive), "svi"])  # (NUTS: ~8 s)
def test_batch_plate_with_a_shared_prior(method):
    """The prior table has no batch dims; `phi_prior` is stored beside `phi` all the same."""
    tasks = [make_task(8, dim=D, q=0.35, noise=0.3, seed=s) for s in (5, 6)]
    x = np.stack([t.x for t in tasks])
    w = tasks[0].weight
    if method == "nuts":
        fit = si.infer.nuts(jax.random.PRNGKey(1), batched_q_model, x, w, 0.3, num_warmup=5,
                            num_samples=5, progress_bar=False)
    else:
        fit = si.infer.svi(jax.random.PRNGKey(0), batched_q_model, x, w, 0.3,
                           optim=numpyro.optim.Adam(0.05), num_steps=5, progress_bar=False)
    dt = dg.to_inference_data(fit, x, w, 0.3, num_draws=5, posterior_predictive=False)
    n = x.shape[1] - 1
    draws = 5
    assert dt["log_likelihood"]["x"].shape == (1, draws, 2, n)
    ep = dt["edge_posterior"]
    assert ep["phi"].shape == ep["phi_prior"].shape == (2, n, n)
    assert ep["phi"].dims == ep["phi_prior"].dims
    # the batch dim is named after its plate, as in log_likelihood (was "phi_dim_0")
    assert ep["phi"].dims == ("batch", "children", "phi_parent")
    assert dt["log_likelihood"]["x"].dims[2:] == ("batch", "children")
    q = dt["posterior"]["q"].values
    want = np.mean(np.exp(geometric_log_prior(n, q.ravel())), axis=0)
    np.testing.assert_allclose(ep["phi_prior"].values, np.broadcast_to(want, (2, n, n)),
                               atol=1e-5)
    np.testing.assert_allclose(ep["phi"].values.sum(-1), 1.0, atol=1e-5)


KEYS3 = jnp.array([0.0, 2.0, 4.0])


def masked_model(x, m):
    """Children observed where ``m`` (missing ones NaN, masked out)."""
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("batch", x.shape[0], dim=-2), numpyro.plate("children", x.shape[1]):
        phi = si.edge("phi", si.priors.Uniform(3))
        with numpyro.handlers.mask(mask=m):
            numpyro.sample("x", dist.Normal(KEYS3[phi], tau), obs=x)


@pytest.mark.filterwarnings("ignore:.*PSIS-LOO is unreliable")  # 40 draws
def test_masked_children_are_not_observations():
    """Regression: children masked out (`handlers.mask`, missing values as NaN) entered
    the log_likelihood group as observations with log-likelihood 0, so `loo` counted
    them (inflating its standard error), and `to_inference_data` refused the fit's own
    NaN data. Now only the observed children are terms (their positions as coordinates),
    and `loo` on them equals `loo` of the same draws' terms over the observed children."""
    x = jnp.array([[0.1, 2.2, 3.9, 0.3], [1.9, jnp.nan, 4.2, jnp.nan]])
    m = ~jnp.isnan(x)
    fit = si.infer.nuts(jax.random.PRNGKey(0), masked_model, x, m, num_warmup=30,
                        num_samples=40, progress_bar=False)
    dt = dg.to_inference_data(fit, x, m, posterior_predictive=False)
    ll = dt["log_likelihood"]["x"]
    assert ll.dims == ("chain", "draw", "x_observed") and ll.shape == (1, 40, 6)
    np.testing.assert_array_equal(ll["batch"].values, [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(ll["children"].values, [0, 1, 2, 3, 0, 2])
    tau = np.asarray(fit.get_samples()["tau"])
    xs = np.asarray(x)[np.asarray(m)]  # the observed children, in the same order
    want = logsumexp(norm.logpdf(xs[None, :, None], np.asarray(KEYS3), tau[:, None, None]),
                     axis=-1) - np.log(3)
    np.testing.assert_allclose(ll.values[0], want, rtol=1e-4, atol=1e-4)
    res = dg.loo(dt)
    assert res.n_data_points == 6 and np.isfinite(res.elpd)
    # one plate: the children kept along it, their positions its coordinate

    def one_plate(x, m):
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with numpyro.plate("children", x.shape[0]):
            phi = si.edge("phi", si.priors.Uniform(3))
            numpyro.sample("x", dist.Normal(KEYS3[phi], tau).mask(m), obs=x)

    fit1 = si.infer.nuts(jax.random.PRNGKey(0), one_plate, x[1], m[1], num_warmup=30,
                         num_samples=40, progress_bar=False)
    ll1 = dg.to_inference_data(fit1, x[1], m[1], posterior_predictive=False)[
        "log_likelihood"]["x"]
    assert ll1.dims == ("chain", "draw", "children") and ll1.shape == (1, 40, 2)
    np.testing.assert_array_equal(ll1["children"].values, [0, 2])
    assert dg.loo(dg.to_inference_data(fit1, x[1], m[1], posterior_predictive=False)
                  ).n_data_points == 2

    # a mask inside another wrapper (`.mask(...).to_event(1)`: an Independent around it)
    def event_mask(x, m):
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with numpyro.plate("children", x.shape[0]):
            phi = si.edge("phi", si.priors.Uniform(3))
            mu = KEYS3[phi][..., None] * jnp.ones(2)
            numpyro.sample("x", dist.Normal(mu, tau).mask(m[:, None]).to_event(1), obs=x)

    x2 = jnp.stack([x[1], x[1] + 0.1], -1)
    fit2 = si.infer.nuts(jax.random.PRNGKey(0), event_mask, x2, m[1], num_warmup=30,
                         num_samples=40, progress_bar=False)
    ll2 = dg.to_inference_data(fit2, x2, m[1], posterior_predictive=False)[
        "log_likelihood"]["x"]
    np.testing.assert_array_equal(ll2["children"].values, [0, 2])


def test_compare_edges_names_the_model_with_several_edge_sites():
    """Regression: `compare_edges` of models one of which has two edge sites raised
    `edge_summary`'s 'several edge sites ['a', 'b']; pass site=' without saying which
    model (the `structinfer compare` note printed it as it was)."""
    import xarray as xr

    a = np.full((3, 4), 0.25)
    one = xr.DataTree.from_dict({"edge_posterior": xr.Dataset({"a": (("c", "p"), a)})})
    two = xr.DataTree.from_dict({"edge_posterior": xr.Dataset(
        {"a": (("c", "p"), a), "b": (("c", "p"), a)})})
    assert list(dg.compare_edges({"one": one}).index) == ["one"]
    with pytest.raises(ValueError, match=r"compare_edges: model 'two': .*several edge sites"):
        dg.compare_edges({"one": one, "two": two})


def scoped_inner(x):
    """`masked_model` without the mask: one plate of children, a Uniform(3) edge each."""
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("children", x.shape[0]):
        phi = si.edge("phi", si.priors.Uniform(3))
        numpyro.sample("x", dist.Normal(KEYS3[phi], tau), obs=x)


X_SCOPED = jnp.array([0.1, 2.2, 3.9, 0.3, 1.9])


@pytest.mark.parametrize("method", ["nuts", "svi"])
def test_scoped_model_names_are_xarray_safe(method):
    """Regression: a model composed with `numpyro.handlers.scope(model, "l1")` (sites and
    plates named `l1/...`) failed inside xarray (a DataTree variable may not hold '/'),
    as ArviZ's own `from_numpyro` does. Every name is stored as `xarray_name(name)` ('/'
    -> '::'), in every group, with the numbers of the same fit of the unscoped model."""
    assert dg.xarray_name("l1/x") == "l1::x" and dg.xarray_name("a/b/c") == "a::b::c"
    assert dg.xarray_name("x") == "x"
    scoped = numpyro.handlers.scope(scoped_inner, "l1")
    true = np.array([0, 1, 2, 0, 1])
    dts = {}
    for name, model in (("plain", scoped_inner), ("scoped", scoped)):
        if method == "nuts":
            fit = si.infer.nuts(jax.random.PRNGKey(0), model, X_SCOPED, num_warmup=20,
                                num_samples=30, progress_bar=False)
        else:
            fit = si.infer.svi(jax.random.PRNGKey(0), model, X_SCOPED, num_steps=20,
                               progress_bar=False)
        true_edges = {"phi" if name == "plain" else "l1/phi": true}
        dts[name] = dg.to_inference_data(fit, X_SCOPED, num_draws=30, num_prior_draws=3,
                                         true_edges=true_edges)
    plain, dt = dts["plain"], dts["scoped"]
    renamed = {"tau": "l1::tau", "x": "l1::x", "phi": "l1::phi", "phi_prior": "l1::phi_prior",
               "phi_true": "l1::phi_true", "children": "l1::children",
               "phi_parent": "l1::phi_parent"}
    for group in ("posterior", "prior", "log_likelihood", "observed_data",
                  "posterior_predictive", "edge_posterior"):
        a, b = plain[group].to_dataset(), dt[group].to_dataset()
        assert sorted(renamed.get(v, v) for v in a.data_vars) == sorted(b.data_vars), group
        for v in a.data_vars:
            w = b[renamed.get(v, v)]
            assert w.dims == tuple(renamed.get(d, d) for d in a[v].dims), (group, v)
            np.testing.assert_allclose(w.values, a[v].values, rtol=1e-5, atol=1e-6)
    assert dt["edge_posterior"].attrs == {"l1::phi.offset": 0}
    assert dt["log_likelihood"]["l1::x"].dims[2:] == ("l1::children",)
    # the sites of the scoped model, as the trace names them, are found by xarray_name
    tr = numpyro.handlers.trace(numpyro.handlers.seed(scoped, 0)).get_trace(X_SCOPED)
    assert dg.xarray_name("l1/tau") in dt["posterior"] and "l1/tau" in tr
    assert dg.xarray_name("l1/x") in dt["observed_data"] and "l1/x" in tr
    # edge_summary takes the site as the model names it, or as stored (was NotFoundError)
    assert dg.edge_summary(dt, site="l1/phi") == dg.edge_summary(dt, site="l1::phi") \
        == dg.edge_summary(dt)
    if method == "nuts":
        with pytest.warns(dg.ParetoKWarning, match="l1::children"):  # 30 draws
            assert np.isfinite(dg.loo(dt).elpd)


def test_names_that_collide_once_xarray_safe_are_refused():
    """`a/x` and `a::x` would both be stored as `a::x`: refused, naming both."""
    def model(x):
        tau = numpyro.sample("a/x", dist.HalfNormal(1.0))
        s = numpyro.sample("a::x", dist.HalfNormal(1.0))
        with numpyro.plate("children", x.shape[0]):
            phi = si.edge("phi", si.priors.Uniform(3))
            numpyro.sample("x", dist.Normal(KEYS3[phi], tau + s), obs=x)

    fit = si.infer.svi(jax.random.PRNGKey(0), model, X_SCOPED, num_steps=2,
                       progress_bar=False)
    with pytest.raises(ValueError, match=r"to_inference_data: .*'a/x'.*'a::x'.*'a::x'"):
        dg.to_inference_data(fit, X_SCOPED, num_draws=5, posterior_predictive=False)


def test_a_scoped_guide_function_keeps_its_fitted_params():
    """Regression: with a guide callable whose `numpyro.param` sites a `scope` names
    (`l1/loc`), `to_inference_data` renamed the params as well as the sites, so ArviZ's
    `Predictive(guide, params=...)` found none of the fitted params under their new names
    and drew the posterior from the params' initial values: finite wrong draws (and
    log-likelihood and edge posteriors from them). The draws now equal the unscoped fit's."""
    def guide(x):
        loc = numpyro.param("loc", 0.0)
        numpyro.sample("tau", dist.LogNormal(loc, 0.01))

    draws = {}
    for name, model, g in (("plain", scoped_inner, guide),
                           ("scoped", numpyro.handlers.scope(scoped_inner, "l1"),
                            numpyro.handlers.scope(guide, "l1"))):
        fit = si.infer.svi(jax.random.PRNGKey(0), model, X_SCOPED, guide=g, num_steps=200,
                           progress_bar=False)
        assert abs(float(next(iter(fit[1].params.values())))) > 0.5  # fitted away from 0
        dt = dg.to_inference_data(fit, X_SCOPED, num_draws=10, posterior_predictive=False)
        draws[name] = dt["posterior"][dg.xarray_name("l1/tau" if name == "scoped" else "tau")]
    np.testing.assert_allclose(draws["scoped"].values, draws["plain"].values, rtol=1e-5)
