"""How many times recognising a model runs it (once or twice per compile, not five
times: each run is Python tracing before XLA starts).

Each model counts its own calls; the first call of `si.attention` (eager and under
`jax.jit`) and `si.explain` may run a one-edge model at most twice (the inspection
trace and the probe program); models with several edges and Markov chains run fewer
times than before the probe program was shared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import matrix
from numpyro.contrib.control_flow import scan
from numpyro.ops.indexing import Vindex

import structinfer as si


class Counted:
    """A model wrapper that counts how often the model body runs."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        self.__name__ = fn.__name__

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def one_edge(q, k, v):
    n = q.shape[-2]
    with numpyro.plate("i", n, dim=-1):
        phi = si.edge("phi", si.priors.Restricted.causal(n, n), si.scores.Dot(q, k, scale=0.5))
        numpyro.deterministic("out", Vindex(v)[phi, :])


def two_edges(q, k, v):
    n = q.shape[-2]
    with numpyro.plate("i", n, dim=-1):
        a = si.edge("a", si.priors.Restricted.causal(n, n), si.scores.Dot(q, k, scale=0.5))
        b = si.edge("b", si.priors.Uniform(n), si.scores.Dot(k, q, scale=0.3))
        numpyro.deterministic("out", Vindex(v)[a, :] + 2.0 * Vindex(v)[b, :])


def three_hops(q, k, v):
    n = q.shape[-2]
    with numpyro.plate("i", n, dim=-1):
        prior = si.priors.Restricted.causal(n, n)
        j = si.edge("hop0", prior, si.scores.Dot(q, k, scale=0.5))
        out = Vindex(v)[j, :]
        for h in (1, 2):
            j = si.edge(f"hop{h}", prior, si.scores.Dot(q, k, scale=0.5), child=j)
            out = out + Vindex(v)[j, :]
        numpyro.deterministic("out", out)


def hmm(em, lt, li):
    prior = si.priors.Markov(lt, li)

    def step(prev, e):
        z = si.edge("z", prior, e, previous=prev)
        numpyro.deterministic("v", jnp.sin(z.astype(em.dtype)) + e[0])
        return z, None

    scan(step, jnp.asarray(-1), em)


def _qkv(n=13, d=3):
    r = np.random.default_rng(0)
    return tuple(jnp.asarray(r.normal(size=(n, d)), jnp.float32) for _ in range(3))


def _hmm_args(t=7, k=3):
    r = np.random.default_rng(1)
    return (jnp.asarray(r.normal(size=(t, k)), jnp.float32),
            jnp.asarray(r.normal(size=(k, k)), jnp.float32), jnp.zeros(k, jnp.float32))


# (model, value site, arguments, the most runs of a first call)
CASES = {
    "one_edge": (one_edge, "out", _qkv, 2),
    "two_edges": (two_edges, "out", _qkv, 4),
    "three_hops": (three_hops, "out", _qkv, 5),
    "markov": (hmm, "v", _hmm_args, 5),
}


# (eager calls of the chain and the three hops compile op by op, ~5 s each: exhaustive)
@pytest.mark.parametrize("case, how", matrix(
    [(c, h) for c in sorted(CASES) for h in ("eager", "jit", "explain")],
    lambda c, h: not (h == "eager" and c in ("markov", "three_hops")),
    ids=[f"{c}-{h}" for c in sorted(CASES) for h in ("eager", "jit", "explain")]))
def test_first_call_runs_the_model_at_most(case, how):
    fn, value, make, most = CASES[case]
    model = Counted(fn)
    args = make()
    if how == "explain":
        assert si.explain(model, value, *args).path == "lowered"
    else:
        f = si.attention(model, value)
        out = (f if how == "eager" else jax.jit(f))(*args)
        # the recognised model gives the exact engine's answer
        ref = jax.jit(lambda *a: si.expectation(fn, value, *a))(*args)
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    runs = model.calls
    assert runs <= most, f"{case} ({how}): the model ran {runs} times, at most {most} expected"
