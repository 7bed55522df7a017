"""SVI and NUTS with the edges enumerated: the worked examples recover the parameters
that simulated their data (run in --quick mode), svi reports failures, and the NUTS
kernel is NumPyro's with its single-chain start found compiled."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import return_hop, return_hop_brute, tilt_model
from numpyro.contrib.control_flow import scan

import structinfer as si

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_conditional_edge_is_the_normalised_posterior(x64):
    r = np.random.default_rng(0)
    S = r.normal(size=(5, 7))
    y = r.normal(size=5)
    v = r.normal(size=7)

    def model(S, y):
        with numpyro.plate("q", 5):
            j = si.infer.conditional_edge("phi", si.priors.Uniform(7), si.scores.Custom(S))
            numpyro.sample("y", dist.Normal(jnp.asarray(v)[j], 0.5), obs=y)

    P = np.exp(S - S.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    lik = np.exp(-0.5 * ((y[:, None] - v[None]) / 0.5) ** 2) / (0.5 * np.sqrt(2 * np.pi))
    np.testing.assert_allclose(si.log_marginal(model, S, y), np.log((P * lik).sum(1)).sum(),
                               rtol=1e-12)


@pytest.mark.parametrize("case", ["broadcast-score", "causal", "child"])
def test_conditional_edge_normalises_every_prior_and_form(case, x64):
    """Regression: the normaliser was recomputed from the score's row count (a (1, m)
    score broadcast over the children took ``log_table(1)`` for every child) and was
    added again on the ``child=`` form, whose rows are already normalised."""
    n, m = 4, 4
    r = np.random.default_rng(1)
    S = r.normal(size=(1, m)) if case == "broadcast-score" else r.normal(size=(n, m))
    y = r.normal(size=n)
    v = r.normal(size=m)
    prior = (si.priors.Restricted.causal(n) if case == "causal"
             else si.priors.Geometric(0.5, m))
    log_p = np.asarray(prior.log_table(n), np.float64)

    def model(S, y):
        with numpyro.plate("q", n):
            kw = {"child": jnp.arange(n)} if case == "child" else {}
            j = si.infer.conditional_edge("phi", prior, si.scores.Custom(S), **kw)
            numpyro.sample("y", dist.Normal(jnp.asarray(v)[j], 0.5), obs=y)

    logits = log_p + np.broadcast_to(S, (n, m))
    P = np.exp(logits - logits.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    lik = np.exp(-0.5 * ((y[:, None] - v[None]) / 0.5) ** 2) / (0.5 * np.sqrt(2 * np.pi))
    np.testing.assert_allclose(si.log_marginal(model, S, y), np.log((P * lik).sum(1)).sum(),
                               rtol=1e-12)


def test_svi_recovers_attention_weights():
    ex = load("infer_svi_attention")
    out = ex.main(["--quick"])
    assert out["losses"][-1] < out["losses"][0]
    # 32 x 5 noisy observations: loose, but far below the error of the initial guess (~1)
    assert out["err_bilinear"] < 0.3
    assert out["err_wv"] < 0.1


def test_nuts_recovers_temperature_and_rate():
    ex = load("infer_nuts_expanding")
    out = ex.main(["--quick"])
    s, true = out["samples"], out["true"]
    for name in ("q", "beta"):
        draws = np.asarray(s[name])
        assert np.all(np.isfinite(draws))
        # the truth lies within 3.5 posterior standard deviations of the posterior mean
        assert abs(draws.mean() - true[name]) < 3.5 * draws.std() + 0.02, name
    # and the posterior is informative: narrower than the prior
    assert np.asarray(s["q"]).std() < 0.2  # Beta(1, 1) has sd 0.29


def test_svi_nonfinite_names_the_step_and_the_site():
    x = jnp.array([1.0, 2.0, 3.0])

    def model(x):
        s = numpyro.param("s", jnp.array(1.0))
        with numpyro.plate("c", 3):
            si.edge("phi", si.priors.Uniform(2), si.scores.Custom(jnp.stack([x, -x], -1)))
            numpyro.factor("bad", -jnp.log(s) * x)  # Adam drives s below 0

    with pytest.raises(si.infer.NonFiniteEnergyError, match=r"svi: .* at step \d+") as err:
        si.infer.svi(jax.random.PRNGKey(0), model, x, optim=numpyro.optim.Adam(5.0),
                     num_steps=20, progress_bar=False)
    assert err.value.step >= 1
    assert "'bad'" in err.value.site


@pytest.mark.filterwarnings("ignore:Out-of-support values")  # NumPyro's, on the NaN
@pytest.mark.parametrize("fit", ["nuts", "svi"])
def test_nan_data_is_named_where_numpyro_finds_no_start(fit):
    def model(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("children", 3):
            phi = si.edge("phi", si.priors.Uniform(2))
            numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[phi], s), obs=y)

    run = {"nuts": lambda *a, **k: si.infer.nuts(*a, num_warmup=2, num_samples=2, **k),
           "svi": lambda *a, **k: si.infer.svi(*a, num_steps=2, **k)}[fit]
    with pytest.raises(si.infer.NonFiniteEnergyError,
                       match=fit + r": no initial point .* model argument 0 .*NaN") as err:
        run(jax.random.key(0), model, jnp.array([-1.0, jnp.nan, 1.1]), progress_bar=False)
    assert err.value.step == 0 and "NaN" in err.value.site


@pytest.mark.filterwarnings("ignore:Out-of-support values")
@pytest.mark.parametrize("fit", ["nuts", "svi"])
def test_no_start_names_the_real_cause(fit):
    """Regression: the diagnosis of NumPyro's "Cannot find valid initial parameters" ran
    the model with its continuous latents unvalued, so for every model NUTS samples it
    named "site 's' is latent and not enumerable" and advised checking the data. The
    latents now take a starting point in their supports: an impossible observation is
    named, and an error in the model is the model's own exception."""
    run = {"nuts": lambda *a, **k: si.infer.nuts(*a, num_warmup=2, num_samples=2, **k),
           "svi": lambda *a, **k: si.infer.svi(*a, num_steps=2, **k)}[fit]

    def impossible(y):
        # y ~ Uniform(loc - 0.5, loc + 0.5), written out: NumPyro 0.15's Uniform has a finite
        # density outside its support
        w = numpyro.sample("w", dist.HalfNormal(0.1))
        with numpyro.plate("children", 3):
            phi = si.edge("phi", si.priors.Uniform(2))
            loc = jnp.array([-1.0, 1.0])[phi]
            si.primitives.potential(
                "y", jnp.where(jnp.abs(y * w / w - loc) < 0.5, 0.0, -jnp.inf))

    with pytest.raises(si.infer.NonFiniteEnergyError,
                       match=r"responsible: 'y' \(log-density is -inf for every structure "
                       r"at index \(2,\)\)"):
        run(jax.random.key(0), impossible, jnp.array([-1.0, 1.0, 5.0]), progress_bar=False)

    if fit == "svi":  # a Markov chain is refused by svi before any start is sought
        return
    lt = jnp.log(jnp.array([[0.9, 0.1], [0.2, 0.8]]))

    def no_initial(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))

        def step(prev, yt):
            z = si.edge("z", si.priors.Markov(lt), previous=prev)
            numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[z], s), obs=yt)
            return z, None

        scan(step, jnp.asarray(-1), y)

    with pytest.raises(ValueError, match=r"edge site 'z': the chain's first edge "
                       r"\(previous=-1\) has no initial distribution") as err:
        run(jax.random.key(0), no_initial, jnp.array([-1.1, 0.9, 1.2, -1.0]),
            progress_bar=False)
    assert "Cannot find valid initial parameters" in str(err.value.__cause__)


@pytest.mark.parametrize("initial", [pytest.param(True, marks=pytest.mark.exhaustive), False])  # (True: ~10 s)
def test_svi_on_a_markov_chain_is_the_exact_elbo(initial):
    """Regression: NumPyro's TraceEnum_ELBO does not contract a scan's chain exactly (it
    sums the time dim like a plate), so `svi` on a Markov edge optimised a finite wrong
    ELBO (a uniform start, a delta guide at s = 1: 9.71 where -log p(s = 1, y) is 7.85),
    and the same 9.71 for a chain with no initial distribution. The loss is now -log p
    from the exact engine (a delta guide: exactly), its gradient too, and a chain with no
    initial distribution is refused."""
    lt = jnp.log(jnp.array([[0.9, 0.1], [0.2, 0.8]]))
    li = jnp.log(jnp.array([0.3, 0.7])) if initial else None

    def chain(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))

        def step(prev, yt):
            z = si.edge("z", si.priors.Markov(lt, li), previous=prev)
            numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[z], s), obs=yt)
            return z, None

        scan(step, jnp.asarray(-1), y)

    y = np.array([-1.1, 0.9, 1.2, -1.0])
    if not initial:
        with pytest.raises(si.infer.NonFiniteEnergyError,
                           match=r"edge site 'z': the chain's first edge \(previous=-1\) "
                           r"has no initial distribution"):
            si.infer.svi(jax.random.key(0), chain, jnp.asarray(y), num_steps=2,
                         progress_bar=False)
        return

    def brute(s):  # -log p(s, y) by the forward algorithm in NumPy
        from scipy.stats import halfnorm, norm
        emit = norm.pdf(y[:, None], np.array([-1.0, 1.0]), s)
        alpha = np.exp(np.asarray(li)) * emit[0]
        for t in range(1, len(y)):
            alpha = (alpha @ np.exp(np.asarray(lt))) * emit[t]
        return -(np.log(alpha.sum()) + halfnorm.logpdf(s))

    fitter, result = si.infer.svi(jax.random.key(0), chain, jnp.asarray(y), guide="delta",
                                  num_steps=300, optim=numpyro.optim.Adam(0.05),
                                  progress_bar=False)
    s_hat = float(fitter.guide.median(result.params)["s"])
    loss = fitter.loss.loss(jax.random.key(1), result.params, chain, fitter.guide,
                            jnp.asarray(y))
    np.testing.assert_allclose(float(loss), brute(s_hat), rtol=1e-5)
    # the fit stops at a mode of p(s | y): it has two (s = 0.122 and 1.044), and which one
    # depends on the start AutoDelta draws (NumPyro 0.15's lies in the second's basin)
    grid = np.linspace(0.02, 2.0, 9901)
    lp = np.array([brute(s) for s in grid])
    inner = np.arange(1, grid.size - 1)
    modes = grid[inner][(lp[inner] < lp[inner - 1]) & (lp[inner] < lp[inner + 1])]
    np.testing.assert_allclose(modes, [0.1222, 1.044], atol=1e-3)
    assert np.min(np.abs(s_hat - modes)) < 5e-3
    assert np.isfinite(np.asarray(result.losses)).all()


class _DeltaNoRsample(dist.Delta):
    """A point mass that declares no reparameterized sampler (as a REINFORCE-only site)."""

    reparametrized_params = []


def test_exact_elbo_refuses_a_guide_without_reparameterized_draws():
    """The exact engine's ELBO (a Markov edge; and every model where NumPyro's TraceEnum_ELBO
    cannot trace dependencies) differentiates through the guide's draws: a guide site with
    no reparameterized sampler would get a silently wrong gradient, so it is named."""
    lt = jnp.log(jnp.array([[0.9, 0.1], [0.2, 0.8]]))

    def chain(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))

        def step(prev, yt):
            z = si.edge("z", si.priors.Markov(lt, jnp.log(jnp.array([0.3, 0.7]))),
                        previous=prev)
            numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[z], s), obs=yt)
            return z, None

        scan(step, jnp.asarray(-1), y)

    def guide(y):
        numpyro.sample("s", _DeltaNoRsample(numpyro.param("s_loc", 0.5)))

    with pytest.raises(ValueError, match=r"svi: guide site 's' \(_DeltaNoRsample\) has no "
                       r"reparameterized sampler"):
        si.infer.svi(jax.random.key(0), chain, jnp.array([-1.1, 0.9, 1.2]), guide=guide,
                     num_steps=2, progress_bar=False)


def test_svi_refuses_bfloat16_parameters_that_numpyros_adam_cannot_move():
    """Regression: `svi` on a bfloat16 Markov chain (its parameters bfloat16) with the
    default optimiser returned the initial parameters, unfitted: NumPyro's Adam (JAX's
    ``example_libraries`` one) rounds ``b2 = 0.999`` to 1 in the parameters' dtype, so
    its bias correction divides by 0 and every step is 0. It is refused, naming the
    parameter; SGD moves the same parameters, and its loss is the forward algorithm's."""
    from scipy.stats import norm

    y = jnp.asarray([-1.1, 0.9, 1.2, -1.0], jnp.bfloat16)

    def chain(y):
        mu = numpyro.param("mu", jnp.array([-0.5, 0.5], jnp.bfloat16))
        lt = jnp.log(jnp.array([[0.9, 0.1], [0.2, 0.8]], jnp.bfloat16))

        def step(prev, yt):
            z = si.edge("z", si.priors.Markov(lt, jnp.zeros(2, jnp.bfloat16)), previous=prev)
            numpyro.sample("y", dist.Normal(mu[z], jnp.asarray(0.5, jnp.bfloat16)), obs=yt)
            return z, None

        scan(step, jnp.asarray(-1), y)

    with pytest.raises(TypeError, match=r"svi: parameter 'mu' is bfloat16.*NumPyro's Adam"):
        si.infer.svi(jax.random.key(0), chain, y, num_steps=2, progress_bar=False)
    fitter, result = si.infer.svi(jax.random.key(0), chain, y, num_steps=20,
                                  optim=numpyro.optim.SGD(0.02), progress_bar=False)
    mu = result.params["mu"]
    assert mu.dtype == jnp.bfloat16 and float(mu[0]) < -0.6 and float(mu[1]) > 0.6
    lt = np.log(np.array([[0.9, 0.1], [0.2, 0.8]]))
    emit = norm.pdf(np.asarray(y, np.float64)[:, None], np.asarray(mu, np.float64), 0.5)
    alpha = 0.5 * emit[0]
    for t in range(1, 4):
        alpha = (alpha @ np.exp(lt)) * emit[t]
    loss = fitter.loss.loss(jax.random.key(1), result.params, chain, fitter.guide, y)
    np.testing.assert_allclose(float(loss), -np.log(alpha.sum()), rtol=1e-2)



def test_svi_takes_a_param_whose_value_is_a_pytree():
    """Regression: a `numpyro.param` whose value is a dict of arrays (how
    `numpyro.contrib.module` stores a Flax / Haiku module's parameters) made `svi` fail in
    its model inspection (numpy's "entry not a 2- or 3- tuple"). It fits now (the MAP of
    this model is the mean of y at each parent, brute force); and a bfloat16 leaf under
    NumPyro's Adam is refused, naming its path."""
    y = jnp.array([1.0, 3.0])

    def model(y, dtype=jnp.float32):
        w = numpyro.param("w", {"a": jnp.zeros(2, dtype), "b": jnp.zeros(2)})
        with numpyro.plate("q", 2):
            phi = si.edge("phi", si.priors.Uniform(2), jnp.zeros((2, 2)))
            numpyro.sample("y", dist.Normal(w["b"][phi] + w["a"][phi].astype(jnp.float32),
                                            1.0), obs=y)

    _, result = si.infer.svi(jax.random.key(0), model, y, num_steps=400,
                             optim=numpyro.optim.Adam(0.05), progress_bar=False)
    w = result.params["w"]
    np.testing.assert_allclose(w["a"] + w["b"], [2.0, 2.0], atol=0.05)
    with pytest.raises(TypeError, match=r"svi: parameter 'w'\['a'\] is bfloat16"):
        si.infer.svi(jax.random.key(0), model, y, dtype=jnp.bfloat16,
                     num_steps=2, progress_bar=False)

Y3 = jnp.array([-1.1, 0.9, 1.2])


@pytest.mark.parametrize("kernel", [si.infer.NUTS, numpyro.infer.NUTS],
                         ids=["structinfer", "numpyro"])
def test_nuts_start_is_found_without_running_the_potential_op_by_op(kernel):
    """NumPyro evaluates one chain's potential eagerly (funsor op by op: hundreds of
    small compilations); structinfer's kernel only ever traces it. An eager run of the
    enumerated model shows as a concrete edge value with an enumeration dim."""
    log = []
    kernel(tilt_model).init(jax.random.PRNGKey(0), 5, model_args=(Y3, log))
    eager_enumerated = [v for v in log if not isinstance(v, jax.core.Tracer) and jnp.ndim(v) > 1]
    if kernel is si.infer.NUTS:
        assert not eager_enumerated
    else:  # the check can fail: NumPyro's own kernel does run it eagerly
        assert eager_enumerated


def test_nuts_draws_are_numpyros():
    """Same key, same draws as numpyro.infer.NUTS (up to float rounding of the compiled
    start; NUTS amplifies rounding, so the chains are short)."""
    draws = []
    for kernel in (si.infer.NUTS, numpyro.infer.NUTS):
        mcmc = numpyro.infer.MCMC(kernel(tilt_model), num_warmup=5, num_samples=5,
                                  progress_bar=False)
        mcmc.run(jax.random.PRNGKey(3), Y3, [])
        draws.append(np.asarray(mcmc.get_samples()["s"]))
    np.testing.assert_allclose(draws[0], draws[1], rtol=1e-4)
    # (a 0-d array target is the default's number)
    mcmc = si.infer.nuts(jax.random.PRNGKey(3), tilt_model, Y3, [], num_warmup=5,
                         num_samples=5, progress_bar=False,
                         target_accept_prob=jnp.asarray(0.8))
    np.testing.assert_allclose(np.asarray(mcmc.get_samples()["s"]), draws[1], rtol=1e-4)
    stats = mcmc.get_extra_fields()
    assert {"energy", "diverging", "potential_energy", "accept_prob", "num_steps",
            "adapt_state.step_size"} <= set(stats)


@pytest.mark.exhaustive  # (~5 s: a NUTS run)
def test_nuts_accepts_an_infinite_deterministic_site():
    """Regression: every site of get_samples() had to be finite, deterministic ones too:
    a model recording a causal prior's log-table (-inf on its forbidden edges) was
    refused with "site 'logp' has non-finite draws". Only latent draws are checked."""
    def model(y):
        q = numpyro.sample("q", dist.Beta(2.0, 2.0))
        prior = si.priors.Geometric(q, 4)
        numpyro.deterministic("logp", prior.log_table(4))
        with numpyro.plate("children", 4):
            phi = si.edge("phi", prior)
            numpyro.sample("y", dist.Normal(jnp.arange(4.0)[phi], 0.5), obs=y)

    mcmc = si.infer.nuts(jax.random.PRNGKey(0), model, jnp.array([0.1, 0.9, 0.2, 2.8]),
                         num_warmup=20, num_samples=10, progress_bar=False)
    samples = mcmc.get_samples()
    assert np.isneginf(samples["logp"]).any() and np.isfinite(samples["q"]).all()


def test_nuts_and_svi_refuse_bad_input():
    with pytest.raises(TypeError, match="rng_key must be one PRNG key"):
        si.infer.nuts(0, tilt_model, Y3, [])
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        si.infer.nuts(jax.random.PRNGKey(0), tilt_model, Y3, [], num_samples=0)
    for bad in (1.5, 0, True, "0.8", jnp.asarray(1.5), jnp.asarray([0.8]), jnp.asarray(True)):
        with pytest.raises(ValueError, match=r"target_accept_prob must be a number in \(0, 1\)"):
            si.infer.nuts(jax.random.PRNGKey(0), tilt_model, Y3, [], target_accept_prob=bad)
    with pytest.raises(ValueError, match="guide must be 'normal', 'delta' or a callable"):
        si.infer.svi(jax.random.PRNGKey(0), tilt_model, Y3, [], guide="laplace")

    def with_param(y):
        s = numpyro.param("s", 1.0)
        with numpyro.plate("children", 3):
            phi = si.edge("phi", si.priors.Uniform(2))
            numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[phi], s), obs=y)

    with pytest.raises(ValueError, match=r"numpyro\.param site\(s\) \['s'\]"):
        si.infer.nuts(jax.random.PRNGKey(0), with_param, Y3)


def _latent_return_hop(v, y, s2):
    """`return_hop` with its first hop's scores a latent site."""
    s1 = numpyro.sample("s1", dist.Normal(0.0, 1.0).expand(s2.shape).to_event(2))
    return_hop(s1, s2, v, y)


def test_numpyros_contraction_of_structural_zeros_has_exact_gradients():
    r"""Regression: NumPyro's own contraction (NUTS's potential, SVI's `TraceEnum_ELBO`) of
    two hops whose product leaves pairs unconnected (log 0 = -inf) had NaN gradients, so
    NUTS found no start and SVI stopped. The potential's gradient at the start NUTS finds
    and the gradient of SVI's loss (a point-mass guide, the negative log joint) equal
    brute force:
    $\partial \log Z / \partial s_1$ is the first hop's posterior marginal, and the
    prior $N(0, 1)$ adds $-s_1$."""
    n = 5
    g = np.random.default_rng(3)
    s2 = g.normal(size=(n, n))
    v, y = g.normal(size=(2, n))
    args = tuple(jnp.asarray(a, jnp.float32) for a in (v, y, s2))

    def expected_grad(s1):  # of -log p(s1, y): s1 - p(hop1 | y, s1)
        s1 = np.asarray(s1, np.float64)
        return s1 - return_hop_brute(s1, s2, v, y)[1]

    kernel = si.infer.NUTS(_latent_return_hop)
    state = kernel.init(jax.random.key(0), 0, None, args, {})
    np.testing.assert_allclose(state.z_grad["s1"], expected_grad(state.z["s1"]), atol=2e-5)

    def guide(v, y, s2):  # a point mass (AutoDelta's start would draw the hidden edges)
        loc = numpyro.param("loc", jnp.zeros(s2.shape))
        numpyro.sample("s1", dist.Delta(loc, event_dim=2))

    fitter, result = si.infer.svi(jax.random.key(1), _latent_return_hop, *args, guide=guide,
                                  num_steps=3, progress_bar=False)
    assert np.all(np.isfinite(result.losses))
    loc = result.params["loc"]
    grad = jax.grad(lambda p: fitter.loss.loss(jax.random.key(2), p, fitter.model,
                                               fitter.guide, *args))(result.params)
    np.testing.assert_allclose(grad["loc"], expected_grad(loc), atol=2e-5)


def _copy_model(x, keys):
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("children", x.shape[0]):
        phi = si.edge("phi", si.priors.Uniform(keys.shape[0]))
        numpyro.sample("x", dist.Normal(keys[phi], tau).to_event(1), obs=x)


def test_numpyros_unenumerated_tools_name_the_edge_and_the_exact_call():
    """NumPyro's ``log_likelihood`` and ``log_density`` run the model with no seed and no
    enumeration: the edge has no PRNG key to be drawn with. That is refused naming the
    site and the exact engine's calls, not NumPyro's bare ``AssertionError``."""
    from numpyro.infer.util import log_density, log_likelihood

    keys = jnp.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    x = keys + 0.3
    calls = [lambda: log_likelihood(_copy_model, {"tau": jnp.array([0.7, 0.7])}, x, keys),
             lambda: log_density(_copy_model, (x, keys), {}, {"tau": 0.7}),
             lambda: numpyro.handlers.substitute(_copy_model, {"tau": 0.7})(x, keys)]
    for call in calls:
        with pytest.raises(ValueError, match=r"edge site 'phi'.*PRNG key.*"
                           r"pointwise_log_likelihood.*log_marginal.*seed"):
            call()


def test_numpyros_discrete_samplers_draw_an_edge_declared_unenumerated():
    """docs/numpyro_tools.md: NumPyro's ``DiscreteHMCGibbs`` draws only discrete sites
    that are not enumerated, so it finds nothing to draw in a plain edge model;
    ``infer={"enumerate": None}`` hands it the edge, whose Gibbs conditional is the
    edge's table, and the exact engine and ``nuts`` refuse that site naming it."""
    from numpyro.infer import HMC, MCMC, NUTS, DiscreteHMCGibbs

    keys = jnp.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = keys[jnp.array([0, 1, 2, 1])] + 0.1

    def model(x, infer=None):
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with numpyro.plate("children", x.shape[0]):
            phi = si.edge("phi", si.priors.Uniform(3), infer=infer)
            numpyro.sample("x", dist.Normal(keys[phi], tau).to_event(1), obs=x)

    # NumPyro's own refusal: a ValueError (0.22), an AssertionError (0.15)
    with pytest.raises((ValueError, AssertionError),
                       match="owns no sites|Cannot detect any discrete latent"):
        MCMC(DiscreteHMCGibbs(NUTS(model)), num_warmup=1, num_samples=1,
             progress_bar=False).run(jax.random.key(0), x)
    drawn = {"enumerate": None}
    # one leapfrog step of fixed size compiles far faster than NUTS; each Gibbs step
    # redraws one child's parent from its conditional
    inner = HMC(model, step_size=0.1, adapt_step_size=False, num_steps=1)
    mcmc = MCMC(DiscreteHMCGibbs(inner), num_warmup=20, num_samples=5, progress_bar=False)
    mcmc.run(jax.random.key(0), x, drawn)
    # the children sit 0.1 from their keys, 10 apart: once each child has been redrawn
    # (20 warm-up steps), every draw takes the true parents
    np.testing.assert_array_equal(mcmc.get_samples()["phi"], np.broadcast_to([0, 1, 2, 1],
                                                                              (5, 4)))
    at = numpyro.handlers.substitute(model, {"tau": 0.5})
    with pytest.raises(ValueError, match="'phi'"):
        si.log_marginal(at, x, drawn)
    with pytest.raises(ValueError, match="'phi'"):
        si.infer.nuts(jax.random.key(0), model, x, drawn, num_warmup=1, num_samples=1)


@pytest.mark.exhaustive  # (~15 s of compiles)
def test_exact_calls_inside_a_numpyro_model_keep_their_sites_and_read_its_params(x64):
    """Regression: ``si.log_marginal`` / ``marginals`` / ``expectation`` / a lowered
    ``si.attention`` called inside an outer NumPyro model ran the inner model under the
    outer model's handlers: its edges and plates reached the outer ``trace``
    (``log_density`` scored them again: -86.9 for -5.7, or a duplicate-name error), while
    the lowering hid the inner model's ``numpyro.param`` from the outer ``substitute``
    (it used the parameter's initial value: a finite wrong number and a zero gradient).
    Now only the parameters pass out, and a lowered function that read one is never
    answered from its cache."""
    from numpyro.handlers import substitute
    from numpyro.infer.util import log_density

    keys = jnp.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    q = keys + jnp.array([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.2]])
    v, y = jnp.array([1.0, -1.0, 0.5]), jnp.array([0.8, -0.5, 0.3])

    def inner(q, keys, t):
        tau = numpyro.param("tau", 1.0)
        with numpyro.plate("children", q.shape[0]):
            j = si.edge("phi", si.priors.Uniform(3), si.scores.Dot(q * t * tau, keys))
            numpyro.deterministic("out", v[j])

    def expected(t, tau):
        s = t * tau * q @ keys.T
        return (dist.LogNormal(0.0, 1.0).log_prob(t)
                + dist.Normal(jax.nn.softmax(s, -1) @ v, 0.5).log_prob(y).sum()
                + jax.nn.logsumexp(s - jnp.log(3.0), -1).sum())

    lowered = si.attention(inner, "out")
    for mean in (lambda t: si.marginals(inner, q, keys, t)["phi"] @ v,
                 lambda t: si.expectation(inner, "out", q, keys, t),
                 lambda t: lowered(q, keys, t)):
        def outer(q, keys, y, mean=mean):
            t = numpyro.sample("t", dist.LogNormal(0.0, 1.0))
            numpyro.factor("z", si.log_marginal(inner, q, keys, t))
            numpyro.sample("y", dist.Normal(mean(t), 0.5), obs=y)

        def f(t, tau, outer=outer):
            return log_density(outer, (q, keys, y), {}, {"t": t, "tau": tau})[0]

        np.testing.assert_allclose(f(1.3, 0.7), expected(1.3, 0.7), rtol=1e-10)
        np.testing.assert_allclose(jax.jit(f)(0.8, 1.6), expected(0.8, 1.6), rtol=1e-10)
        np.testing.assert_allclose(jax.jit(jax.grad(f, 1))(1.3, 0.7),
                                   jax.grad(expected, 1)(1.3, 0.7), rtol=1e-8)
    tr = numpyro.handlers.trace(numpyro.handlers.seed(outer, 0)).get_trace(q, keys, y)
    assert {name: s["type"] for name, s in tr.items()} == {
        "t": "sample", "tau": "param", "z": "sample", "y": "sample"}
    # the lowered function read a param: a plain call afterwards is not the cached one
    plain = si.expectation(inner, "out", q, keys, 1.3)
    np.testing.assert_allclose(lowered(q, keys, 1.3), plain, rtol=1e-10)
    with substitute(data={"tau": 0.5}):
        np.testing.assert_allclose(lowered(q, keys, 1.3), si.expectation(
            substitute(inner, data={"tau": 0.5}), "out", q, keys, 1.3), rtol=1e-10)
    # the parameter the only traced input (jit, vmap over it) with concrete data
    at = jnp.array([0.5, 2.0])
    want = jnp.stack([si.expectation(substitute(inner, data={"tau": t}), "out", q, keys, 1.3)
                      for t in at])

    def by_tau(tau):
        return substitute(lowered, data={"tau": tau})(q, keys, 1.3)

    np.testing.assert_allclose(jax.jit(by_tau)(at[0]), want[0], rtol=1e-10)
    np.testing.assert_allclose(jax.vmap(by_tau)(at), want, rtol=1e-10)
    # NumPyro's infer_discrete (the MAP and draws) enumerates under a block of its own: it
    # gets the parameter the handlers around gave (a negative tau reverses the MAP)
    s = -2.6 * q @ keys.T
    with substitute(data={"tau": -2.0}):
        best = si.map_edges(inner, q, keys, 1.3)["phi"]
        draws = jax.vmap(lambda key: si.sample_edges(key, inner, q, keys, 1.3)["phi"])(
            jax.random.split(jax.random.PRNGKey(0), 2000))
    np.testing.assert_array_equal(best, jnp.argmax(s, -1))
    freq = (draws[..., None] == jnp.arange(3)).mean(0)
    np.testing.assert_allclose(freq, jax.nn.softmax(s, -1), atol=0.04)


def test_an_exact_call_inside_a_model_the_engine_enumerates_is_refused_naming_both():
    """Regression: ``si.log_marginal`` / ``si.expectation`` of an inner model called inside
    a model that the exact engine enumerates blamed the outer model for a leftover tensor
    dim (NumPyro's enumeration does not nest). The error now names both models and the
    ways out; a lowered inner call, which does not enumerate, works there."""
    keys = jnp.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    x = keys + jnp.array([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.2]])
    v = jnp.array([1.0, -1.0, 0.5])

    def inner(x, keys):
        with numpyro.plate("children", x.shape[0]):
            j = si.edge("phi", si.priors.Uniform(3), si.scores.Dot(x, keys))
            numpyro.deterministic("out", v[j])

    def own(x, keys):
        with numpyro.plate("c2", x.shape[0]):
            si.edge("psi", si.priors.Uniform(3), si.scores.Dot(-x, keys))

    def outer_with(sub):
        def outer(x, keys):
            numpyro.factor("sub", sub())
            own(x, keys)
        return outer

    for sub in (lambda: si.log_marginal(inner, x, keys),
                lambda: si.expectation(inner, "out", x, keys).sum(),
                lambda: si.map_edges(inner, x, keys)["phi"].sum()):
        with pytest.raises(ValueError, match=r"model 'inner' is given to an exact call.*"
                           r"inside model 'outer'.*does not nest.*si.attention"):
            si.log_marginal(outer_with(sub), x, keys)
    lowered = si.attention(inner, "out")
    np.testing.assert_allclose(
        si.log_marginal(outer_with(lambda: lowered(x, keys).sum()), x, keys),
        lowered(x, keys).sum() + si.log_marginal(own, x, keys), rtol=1e-5)


def test_nuts_on_a_layer_under_numpyro_scope():
    """``numpyro.handlers.scope`` renames a layer's plates; NumPyro's enumerated potential
    named the plate's dim after the plate itself and left it over. structinfer's kernel
    contracts it, and its potential at the start is the exact engine's."""
    def layer(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("children", 3):
            phi = si.edge("phi", si.priors.Uniform(2))
            numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[phi], s), obs=y)

    def model(y):
        numpyro.handlers.scope(layer, "a")(y)

    y = jnp.array([-1.0, 0.9, 1.1])
    state = si.infer.NUTS(model).init(jax.random.PRNGKey(0), 0, model_args=(y,))
    s = jnp.exp(state.z["a/s"])  # HalfNormal's unconstrained value is log s
    at = numpyro.handlers.substitute(model, {"a/s": s})
    expected = -(si.log_marginal(at, y) + jnp.log(s))  # minus log p(s, y) + log|ds/dz|
    np.testing.assert_allclose(state.potential_energy, expected, rtol=1e-5)


def _scoped_scan_layer(y):
    """A layer whose ``scan`` step has a continuous latent site: x_t ~ N(0, 1),
    o_tk ~ N(x_t, 1) for k in a plate of the step."""
    def step(carry, yt):
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))
        with numpyro.plate("kids", yt.shape[0]):
            numpyro.sample("o", dist.Normal(x, 1.0), obs=yt)
        return carry, None

    scan(step, 0.0, y)


def _scoped_scan_model(y):
    numpyro.handlers.scope(_scoped_scan_layer, "l1")(y)


def test_nuts_potential_of_a_scan_with_continuous_steps_under_scope():
    """Regression: ``numpyro.handlers.scope`` around a ``scan`` whose step has a
    continuous latent site. NumPyro hands a ``substitute``'s values to the scan, which
    looks them up by the step's own names ('x') while the sampler holds them under the
    scope's ('l1/x'): the step never got the sampler's value, so the potential drew x
    without a key (a bare AssertionError, with an edge in the model) or at random (a
    potential flat in x: NUTS drifted to 1e19). The posterior is conjugate:
    x_t | y ~ N(sum_k y_tk / (K + 1), 1 / (K + 1)); log p(x, y) by hand."""
    y = jnp.array([[0.5, 0.1], [-0.3, 0.2], [1.2, 1.0]])
    K = y.shape[1]

    def log_joint(x):  # log p(x, y), by hand
        x = np.asarray(x, np.float64)
        ly = np.asarray(y, np.float64)
        return float((-0.5 * x ** 2).sum() - 0.5 * ((ly - x[:, None]) ** 2).sum()
                     - 0.5 * x.size * (1 + K) * np.log(2 * np.pi))

    v = jnp.array([0.3, -0.2, 0.9])
    np.testing.assert_allclose(
        si.log_marginal(numpyro.handlers.substitute(_scoped_scan_model, {"l1/x": v}), y),
        log_joint(v), rtol=1e-5)
    state = si.infer.NUTS(_scoped_scan_model).init(jax.random.PRNGKey(0), 0, model_args=(y,))
    np.testing.assert_allclose(state.potential_energy, -log_joint(state.z["l1/x"]), rtol=1e-5)


@pytest.mark.exhaustive  # two fits (~10 s); the potential above is the default tier's check
def test_nuts_and_svi_fit_a_scan_with_continuous_steps_under_scope():
    """The fits of the model above: NUTS's draws and the point-mass guide's MAP match the
    conjugate posterior x_t | y ~ N(sum_k y_tk / (K + 1), 1 / (K + 1))."""
    y = jnp.array([[0.5, 0.1], [-0.3, 0.2], [1.2, 1.0]])
    K = y.shape[1]
    mean = np.asarray(y.sum(1) / (K + 1))
    mcmc = si.infer.nuts(jax.random.PRNGKey(0), _scoped_scan_model, y, num_warmup=200,
                         num_samples=400, progress_bar=False)
    draws = mcmc.get_samples()["l1/x"]
    assert draws.shape == (400, 3)
    np.testing.assert_allclose(draws.mean(0), mean, atol=0.15)  # sd 0.58 / sqrt(400 / 3)
    np.testing.assert_allclose(draws.std(0), np.sqrt(1 / (K + 1)), rtol=0.25)
    # svi: the MAP (= the posterior mean here) with a point-mass guide
    _, res = si.infer.svi(jax.random.PRNGKey(0), _scoped_scan_model, y, guide="delta",
                          optim=numpyro.optim.Adam(0.05), num_steps=400, progress_bar=False)
    np.testing.assert_allclose(res.params["l1/x_auto_loc"], mean, atol=1e-3)


@pytest.mark.exhaustive  # (~5 s: an SVI fit)
def test_svi_on_a_scan_with_an_edge_in_its_steps():
    """Regression: NumPyro's TraceEnum_ELBO does not contract an edge in a scan's step:
    here it gave a finite wrong MAP (0.350 for 0.338), and with a latent site in the step
    it fails (``KeyError: 'kids'``, the step's plate); `svi` takes the ELBO from the exact
    engine for every model with a site in a scan's steps. The point-mass guide's x
    maximises log p(x) + sum_t,k log sum_j p(j) N(y_tk; V_j + x, 1), found on a grid."""
    V = jnp.array([-1.0, 0.0, 1.0])
    y = jnp.array([[0.5, 0.1], [-0.3, 0.2], [1.2, 1.0]])

    def model(y):
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))

        def step(carry, yt):
            with numpyro.plate("kids", yt.shape[0]):
                j = si.edge("phi", si.priors.Uniform(3))
                numpyro.sample("o", dist.Normal(V[j] + x, 1.0), obs=yt)
            return carry, None

        scan(step, 0.0, y)

    def log_joint(x):
        lik = jax.nn.logsumexp(jax.scipy.stats.norm.logpdf(y[..., None], V + x) - jnp.log(3), -1)
        return jax.scipy.stats.norm.logpdf(x) + lik.sum()

    grid = jnp.linspace(-1.0, 1.0, 20001)
    x_map = grid[jnp.argmax(jax.vmap(log_joint)(grid))]
    _, res = si.infer.svi(jax.random.PRNGKey(0), model, y, guide="delta",
                          optim=numpyro.optim.Adam(0.05), num_steps=400, progress_bar=False)
    np.testing.assert_allclose(res.params["x_auto_loc"], x_map, atol=1e-3)


def test_a_scope_around_a_scan_with_an_edge_and_a_continuous_site_names_the_edge():
    """The refusal of a scope around an enumerated scan names the enumerated site, not the
    step's first site (a continuous one, which the scope no longer breaks)."""
    def layer(y):
        def step(carry, yt):
            x = numpyro.sample("x", dist.Normal(0.0, 1.0))
            with numpyro.plate("kids", 2):
                j = si.edge("phi", si.priors.Uniform(3))
                numpyro.sample("o", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[j] + x, 1.0),
                               obs=yt)
            return carry, None

        scan(step, 0.0, y)

    def model(y):
        numpyro.handlers.scope(layer, "l1")(y)

    y = jnp.zeros((3, 2))
    with pytest.raises(ValueError, match=r"site 'phi' of a numpyro.contrib.control_flow.scan "
                       r"step is recorded as 'l1/phi'.*scan\(numpyro.handlers.scope"):
        si.infer.nuts(jax.random.PRNGKey(0), model, y, num_warmup=2, num_samples=2,
                      progress_bar=False)


def test_nuts_draws_a_deterministic_site_that_reads_an_edge_at_posterior_edges():
    """Regression: NumPyro's MCMC recorded a deterministic site computed from an
    enumerated edge as the model computes it under enumeration: its value at every parent
    (shape (parents, 1) for 2 children), the same at every draw. `nuts` gives its value
    at edges drawn from p(phi | y, s) at each draw of s; a site that reads no edge is
    NumPyro's. The edge posterior is by hand: p(phi_i = j | y, s) ∝ N(y_i; V_j, s)."""
    V = jnp.array([-1.0, 0.0, 1.0])
    y = jnp.array([-0.9, 0.4])

    def model(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("kids", 2):
            j = si.edge("phi", si.priors.Uniform(3))
            numpyro.deterministic("out", 10.0 * V[j])
            numpyro.sample("y", dist.Normal(V[j], s), obs=y)
        numpyro.deterministic("twice_s", 2.0 * s)

    mcmc = si.infer.nuts(jax.random.PRNGKey(1), model, y, num_warmup=50, num_samples=400,
                         progress_bar=False)
    samples = mcmc.get_samples()
    s, out = np.asarray(samples["s"]), np.asarray(samples["out"])
    assert out.shape == (400, 2)
    assert set(np.unique(out)) <= {-10.0, 0.0, 10.0}
    np.testing.assert_allclose(samples["twice_s"], 2 * s, rtol=1e-6)
    assert mcmc.get_samples(group_by_chain=True)["out"].shape == (1, 400, 2)
    logp = -0.5 * ((np.asarray(y)[None, :, None] - np.asarray(V)) / s[:, None, None]) ** 2
    post = np.exp(logp - logp.max(-1, keepdims=True))
    post /= post.sum(-1, keepdims=True)  # (draw, child, parent)
    expected = (post * 10 * np.asarray(V)).sum(-1)  # E[out | y, s] per draw
    sd = np.sqrt(((post * 100 * np.asarray(V) ** 2).sum(-1) - expected ** 2).mean(0) / 400)
    assert np.all(np.abs(out.mean(0) - expected.mean(0)) < 4 * sd), (out.mean(0), expected)


def test_the_likelihood_structure_of_a_scan_with_a_latent_step_site_says_why_not():
    """Regression: a latent site in a scan's steps was not given a placeholder (the
    inspection draws it inside the step), so `likelihood_structure` (and so
    `to_inference_data` on such a fit) failed with "site 'l1/_PREV_x' is latent ...
    give it a value", instead of the reason there is no pointwise log-likelihood."""
    y = jnp.zeros((3, 2))
    with pytest.raises(ValueError, match=r"site 'l1/x' lies on a Markov chain.*no pointwise"):
        si.exact.likelihood_structure(_scoped_scan_model, None, y)


def test_nuts_on_a_scan_model_with_a_deterministic_site_that_reads_an_edge_returns():
    """Regression: with a deterministic site reading an edge and a ``scan`` elsewhere in
    the model, `nuts` redrew the site at posterior edge draws through `sample_edges`,
    whose NumPyro ``infer_discrete`` does not support a scan: an ``UnboundLocalError``
    from inside NumPyro after the whole run (the model ran before). The site is left out
    of the samples with a warning (NumPyro's values there are one per parent, not
    draws); the continuous site is sampled."""
    V = jnp.array([-1.0, 0.0, 1.0])
    y = jnp.array([0.5, -0.3, 1.2])

    def model(y):
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))
        with numpyro.plate("kids", 2):
            j = si.edge("psi", si.priors.Uniform(3))
            numpyro.deterministic("d", 10.0 * V[j])
            numpyro.sample("w", dist.Normal(V[j] + x, 1.0), obs=jnp.array([0.9, 1.1]))

        def step(carry, yt):
            numpyro.sample("o", dist.Normal(x, 1.0), obs=yt)
            return carry, None

        scan(step, 0.0, y)

    with pytest.warns(UserWarning, match=r"deterministic site\(s\) \['d'\] read an edge"):
        mcmc = si.infer.nuts(jax.random.PRNGKey(0), model, y, num_warmup=20,
                             num_samples=20, progress_bar=False)
    assert mcmc.get_samples()["x"].shape == (20,) and "d" not in mcmc.get_samples()

    def markov_model(em):  # a Markov chain beside another edge read by a deterministic site
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        prior = si.priors.Markov(jnp.zeros((3, 3)), jnp.zeros(3))
        scan(lambda prev, e: (si.edge("z", prior, e * mu, previous=prev), None),
             jnp.asarray(-1), em)
        with numpyro.plate("c", 2):
            j = si.edge("j", si.priors.Uniform(3), em[:2] * mu)
            numpyro.deterministic("dj", 10.0 * j)

    em = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    with pytest.warns(UserWarning, match=r"\['dj'\] read an edge"):
        mcmc = si.infer.nuts(jax.random.PRNGKey(0), markov_model, em, num_warmup=20,
                             num_samples=20, progress_bar=False)
    assert mcmc.get_samples()["mu"].shape == (20,) and "dj" not in mcmc.get_samples()
