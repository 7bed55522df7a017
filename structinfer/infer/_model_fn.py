"""Energies of a model as functions of one of its arguments (the latent means or parameters)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ..exact import log_marginal
from ._diagnose import nonfinite_site

__all__ = ["ModelFunction", "model_energy", "model_log_z"]


class ModelFunction:
    r"""$\mu \mapsto \pm\log \sum_\phi p(x, \phi; \mu)$, the model as a jittable callable.

    Calls ``model(*args, **{argname: value}, **kwargs)`` through the exact engine and
    multiplies by ``sign``. Keeps the model so that a failing value can be traced back
    to a site (`site`). Build it with
    [`model_energy`][structinfer.infer.model_energy] or
    [`model_log_z`][structinfer.infer.model_log_z].

    Args:
        model: a NumPyro model with edge sites.
        argname: the keyword argument that carries the value.
        args: the model's other positional arguments.
        kwargs: the model's other keyword arguments (not ``argname``).
        sign: $-1$ for the energy, $+1$ for $\log Z$.

    Raises:
        TypeError: ``model`` is not callable or ``argname`` is not a non-empty str.
        ValueError: ``argname`` is also in ``kwargs``.
    """

    def __init__(self, model: Callable, argname: str, args: tuple, kwargs: dict, sign: float):
        if not callable(model):
            raise TypeError(f"model must be a callable NumPyro model, got {type(model).__name__}")
        if not isinstance(argname, str) or not argname:
            raise TypeError(f"the latent argument name must be a non-empty str, got {argname!r}")
        if argname in kwargs:
            raise ValueError(
                f"'{argname}' is the argument being optimised; do not also pass it in kwargs"
            )
        self.model, self.argname, self.args, self.kwargs, self.sign = (
            model, argname, tuple(args), dict(kwargs), sign)

    def __call__(self, value: Any) -> jax.Array:
        return self.sign * log_marginal(self.model, *self.args, **{self.argname: value}, **self.kwargs)

    def site(self, value: Any) -> str | None:
        """The argument or site that makes the energy non-finite at ``value`` (eager).

        Args:
            value: the value of the model's argument ``argname``.

        Returns:
            A description of the first bad argument or site, or ``None``.
        """
        return nonfinite_site(self.model, *self.args, **{self.argname: value}, **self.kwargs)

    def __repr__(self) -> str:
        kind = "energy" if self.sign < 0 else "log_z"
        name = getattr(self.model, "__name__", type(self.model).__name__)
        return f"model_{kind}({name}, {self.argname!r})"


def model_energy(model: Callable, argname: str, *args: Any, **kwargs: Any) -> ModelFunction:
    r"""The collapsed free energy as a function of one keyword argument of the model.

    $$F(\mu) = -\log \sum_\phi p(x, \mu, \phi)$$

    (Singh & Buckley eq. 4: the Laplace / delta approximation of the variational
    free energy with the edges collapsed). ``model(*args, **{argname: mu}, **kwargs)``
    must accept ``mu``; continuous latent nodes enter the model as this argument
    (e.g. through ``numpyro.factor`` node potentials and scores built from it).

    Args:
        model: a NumPyro model with edge sites.
        argname: the keyword argument that carries $\mu$.
        *args: the model's positional arguments.
        **kwargs: the model's other keyword arguments.

    Returns:
        A jittable, differentiable callable ``mu -> F(mu)`` (a `ModelFunction`).

    Raises:
        TypeError: ``model`` is not callable or ``argname`` is not a non-empty str.
        ValueError: ``argname`` is also in ``kwargs``.
    """
    return ModelFunction(model, argname, args, kwargs, -1.0)


def model_log_z(model: Callable, argname: str, *args: Any, **kwargs: Any) -> ModelFunction:
    r"""$G(\mu) = \log \sum_\phi p(x, \mu, \phi)$ as a function of one keyword argument.

    The concave part of the free energy that CCCP linearises (see
    [`cccp`][structinfer.infer.cccp]); the negative of
    [`model_energy`][structinfer.infer.model_energy].

    Args:
        model: a NumPyro model with edge sites.
        argname: the keyword argument that carries $\mu$.
        *args: the model's positional arguments.
        **kwargs: the model's other keyword arguments.

    Returns:
        A jittable, differentiable callable ``mu -> G(mu)`` (a `ModelFunction`).

    Raises:
        TypeError: ``model`` is not callable or ``argname`` is not a non-empty str.
        ValueError: ``argname`` is also in ``kwargs``.
    """
    return ModelFunction(model, argname, args, kwargs, 1.0)
