r"""NUTS over continuous hyperparameters with the edges enumerated.

NumPyro's HMC/NUTS sums out every site marked ``infer={"enumerate": "parallel"}``
(all :func:`structinfer.edge` sites) with funsor, so the sampler sees the
collapsed potential

.. math:: U(\theta) = -\log p(\theta) - \log \sum_\phi p(x, y, \phi \mid \theta)

for the continuous sites :math:`\theta` (the geometric rate :math:`q`, a
temperature :math:`\beta`, :math:`W_Q`, ...). :func:`posterior_marginals` then
averages the exact edge posterior over the draws:
:math:`p(\phi \mid x, y) = \mathbb E_{\theta \mid x, y}[p(\phi \mid x, y, \theta)]`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from numpyro.diagnostics import summary
from numpyro.handlers import substitute
from numpyro.infer import MCMC, NUTS

from ..exact import marginals

__all__ = ["run_nuts", "posterior_marginals"]


def run_nuts(
    model: Callable,
    *args,
    num_warmup: int = 500,
    num_samples: int = 500,
    num_chains: int = 1,
    rng_key: jax.Array | None = None,
    target_accept_prob: float = 0.8,
    **kwargs,
) -> tuple[MCMC, dict]:
    r"""Run NUTS on the continuous sites of a model whose edge sites are enumerated.

    Args:
        model: a NumPyro model with :func:`structinfer.edge` sites; the continuous
            latent sites (hyperparameters) are sampled, the edges summed out exactly.
        *args, **kwargs: the model's arguments.
        num_warmup, num_samples, num_chains: as in :class:`numpyro.infer.MCMC`.
        rng_key: PRNG key (default ``PRNGKey(0)``).
        target_accept_prob: NUTS step-size adaptation target.

    Returns:
        ``(mcmc, summary)``: the :class:`~numpyro.infer.MCMC` object (``.get_samples()``)
        and ``numpyro.diagnostics.summary`` of the draws (mean, sd, n_eff, r_hat per site).

    Raises:
        FloatingPointError: if any draw is not finite (naming the site).

    Reference: NUTS over continuous hyper-parameters with edges enumerated, e.g. the geometric ``q`` of expanding attention (Singh & Buckley sec. 5.2).
    """
    key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    mcmc = MCMC(NUTS(model, target_accept_prob=target_accept_prob), num_warmup=num_warmup,
                num_samples=num_samples, num_chains=num_chains, progress_bar=False)
    mcmc.run(key, *args, **kwargs)
    samples = mcmc.get_samples(group_by_chain=True)
    for name, v in samples.items():
        if not bool(jnp.all(jnp.isfinite(v))):
            raise FloatingPointError(
                f"run_nuts: site '{name}' has non-finite draws; check the priors' support and "
                "the data for NaN/inf"
            )
    return mcmc, summary(samples, group_by_chain=True)


def posterior_marginals(model: Callable, samples: dict, *args, **kwargs) -> dict[str, jax.Array]:
    r"""Edge marginals averaged over posterior draws of the continuous sites:

    .. math:: p(\phi_i = j \mid \mathcal D) \approx \frac1S \sum_s p(\phi_i = j \mid \mathcal D, \theta^{(s)}).

    Args:
        model: the model.
        samples: ``{site: (S, ...)}`` draws (``mcmc.get_samples()``).
        *args, **kwargs: the model's arguments.

    Returns:
        ``{edge site: (..., children, parents)}``.
    """
    if not samples:
        raise ValueError("posterior_marginals: `samples` is empty")

    def one(s):
        return marginals(substitute(model, data=s), *args, **kwargs)

    per = jax.lax.map(one, samples)
    return {k: jnp.mean(v, axis=0) for k, v in per.items()}
