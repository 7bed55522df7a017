r"""Effect handlers the exact engine is built from (NumPyro ``Messenger`` subclasses).

* :class:`tilt` — adds a zero "tilt" :math:`t` to a site so that the gradient of
  :math:`\log Z` with respect to it is that site's posterior marginal or
  expectation (:math:`\partial_t \log \sum_\phi e^{\log p + t\cdot f} = E[f]`).
* :class:`require_values` — refuses continuous latent sites with no value, so the
  engine never silently samples them.
* :class:`fill_discrete` — gives every enumerable site a placeholder value of its
  batch shape (used to read shapes without enumerating).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro.primitives import Messenger

from .primitives import gather, is_enumerated

__all__ = [
    "tilt",
    "require_values",
    "fill_discrete",
    "pin",
    "TiltedDistribution",
    "TILT_PREFIX",
]

#: prefix of the factor sites :class:`tilt` adds for deterministic sites
TILT_PREFIX = "_structinfer_tilt:"


class TiltedDistribution(dist.Distribution):
    r"""``base`` with an extra additive term: :math:`\log p(v) + t[..., v]` (unnormalised).

    Only used inside the exact engine: the tilt is zero, so the value of
    :math:`\log Z` is unchanged, but its gradient with respect to ``t`` is the
    posterior marginal of the site.
    """

    def __init__(self, base: dist.Distribution, t: jax.Array):
        self.base = base
        self.t = t
        super().__init__(batch_shape=base.batch_shape, event_shape=base.event_shape)

    @property
    def support(self):
        return self.base.support

    @property
    def has_enumerate_support(self):
        return self.base.has_enumerate_support

    def enumerate_support(self, expand=True):
        return self.base.enumerate_support(expand=expand)

    def sample(self, key, sample_shape=()):
        return self.base.sample(key, sample_shape)

    def log_prob(self, value):
        return self.base.log_prob(value) + gather(self.t, value)


class tilt(Messenger):
    """Add zero tilts to sites: ``tilts = {name: (t, event_dim)}``.

    * an enumerated sample site ``name`` with ``t`` of shape ``batch + (support,)``:
      its log-prob gains ``t[..., value]``;
    * a deterministic site with ``t`` of the value's (non-enumerated) shape and
      ``event_dim`` trailing event dims: a factor ``sum_event(t * value)`` is added.
    """

    def __init__(self, fn=None, tilts: dict | None = None, max_plate_nesting: int = 0):
        if not isinstance(tilts, dict) or not tilts:
            raise ValueError("tilt: `tilts` must be a non-empty dict {site: (t, event_dim)}")
        self.tilts = tilts
        self.max_plate_nesting = max_plate_nesting
        super().__init__(fn)

    def process_message(self, msg):
        name = msg.get("name")
        if msg["type"] == "sample" and name in self.tilts:
            t, _ = self.tilts[name]
            msg["fn"] = TiltedDistribution(msg["fn"], t)

    def postprocess_message(self, msg):
        name = msg.get("name")
        if msg["type"] != "deterministic" or name not in self.tilts:
            return
        t, event_dim = self.tilts[name]
        v = jnp.asarray(msg["value"])
        if event_dim:
            ev_shape, ev_ref = v.shape[-event_dim:], t.shape[-event_dim:]
            if ev_shape != ev_ref:
                raise ValueError(
                    f"deterministic site '{name}': under enumeration its value has trailing "
                    f"shape {ev_shape} where {ev_ref} was expected — record the value inside "
                    "the plates of the children it depends on, and index parent tables with "
                    "structinfer.gather / numpyro.ops.indexing.Vindex"
                )
        lead = v.ndim - event_dim - self.max_plate_nesting
        if lead <= 0:
            raise ValueError(
                f"deterministic site '{name}' does not depend on any edge site: its value "
                "is the same under every structure, so it has no posterior expectation to "
                "compute (use the value directly, or build it from the edge variables)"
            )
        if event_dim:
            # <t, v> over the event dims as one contraction: never the broadcast product,
            # which is (enumerated values x children x event) for a value read at an edge
            flat = lambda x: jnp.reshape(x, x.shape[: x.ndim - event_dim] + (-1,))  # noqa: E731
            term = jnp.einsum("...e,...e->...", flat(t), flat(v),
                              precision=jax.lax.Precision.HIGHEST)
        else:
            term = t * v
        numpyro.factor(TILT_PREFIX + name, term)


class require_values(Messenger):
    """Raise a clear error at a latent, non-enumerated sample site that has no value."""

    def __init__(self, fn=None, what: str = "the exact engine"):
        self.what = what
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "sample" or msg["is_observed"] or msg.get("value") is not None:
            return
        if is_enumerated(msg) and msg["fn"].has_enumerate_support:
            return
        raise ValueError(
            f"sample site '{msg['name']}' is latent and not enumerable, so {self.what} "
            "cannot collapse it: give it a value with numpyro.handlers.substitute / "
            "condition (e.g. a posterior draw), or mark a discrete site with "
            "infer={'enumerate': 'parallel'}"
        )


class fill_discrete(Messenger):
    """Give each enumerable site a placeholder value (zeros of its batch shape)."""

    def process_message(self, msg):
        if msg["type"] == "sample" and msg.get("value") is None and not msg["is_observed"]:
            if is_enumerated(msg) and msg["fn"].has_enumerate_support:
                msg["value"] = jnp.zeros(msg["fn"].batch_shape, dtype=jnp.int32)


class pin(Messenger):
    """Fix discrete sites to given values as observations (their log-prob is kept) and
    take them out of enumeration. Used for single-parent edge sites, which funsor's
    MAP/sampling cannot read a point from."""

    def __init__(self, fn=None, data: dict | None = None):
        self.data = dict(data or {})
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["name"] in self.data:
            msg["value"] = self.data[msg["name"]]
            msg["is_observed"] = True
            msg["infer"] = {k: v for k, v in msg["infer"].items() if k != "enumerate"}
