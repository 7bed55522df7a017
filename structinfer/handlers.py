r"""Effect handlers (NumPyro ``Messenger`` subclasses): the exact engine's, and one for models.

* [`tilt`][structinfer.handlers.tilt] — adds a zero "tilt" $t$ to a site so that the
  gradient of $\log Z$ with respect to it is that site's posterior marginal or
  expectation ($\partial_t \log \sum_\phi e^{\log p + t\cdot f} = E[f]$ at $t = 0$).
* [`mask_parents`][structinfer.handlers.mask_parents] — restricts every edge site in
  scope to the parents a boolean mask allows (key padding; a model's attention mask).
* [`require_values`][structinfer.handlers.require_values] — refuses continuous latent
  sites with no value, so the engine never silently samples them.
* [`fill_discrete`][structinfer.handlers.fill_discrete] — gives every enumerable site a
  placeholder value of its batch shape (used to read shapes without enumerating).
* [`pin`][structinfer.handlers.pin] — fixes discrete sites to given values and takes
  them out of enumeration.
* [`observe_given`][structinfer.handlers.observe_given] — observes an enumerable site
  the model already gave a value (``numpyro.handlers.substitute``), as
  ``numpyro.handlers.condition`` would.
* [`fill_latent`][structinfer.handlers.fill_latent] — gives every other latent sample
  site without a value a placeholder inside its support, without sampling (used to read
  a model that is still to be fitted).
* [`name_plate_dims`][structinfer.handlers.name_plate_dims] — names each plate's
  enumerated tensor dim as the plate the site records (``numpyro.handlers.scope``
  renames plates).
* [`contain`][structinfer.handlers.contain] — keeps the sites of a model the engine runs
  inside the engine call, passing parameters and parent masks on to the handlers around;
  [`replay_outside`][structinfer.handlers.replay_outside] gives a later run what they
  answered.
"""

from __future__ import annotations

import contextvars
import copy
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.custom_derivatives import SymbolicZero
from numpyro.distributions.batch_util import promote_batch_shape
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import block
from numpyro.handlers import trace as numpyro_trace
from numpyro.ops.indexing import Vindex
from numpyro.primitives import Messenger, apply_stack

from .primitives import (
    EDGE_INFO_KEY,
    EDGE_SEEN_KEY,
    ENGINE_DEPTH,
    MASK_PARENTS_TYPE,
    SCAN_INDEX_KEY,
    SCAN_RECORD_KEY,
    STEP_EDGES,
    Potential,
    gather,
    hidden_edge_error,
    is_enumerated,
    is_factor,
    potential,
    user_site_name,
)

__all__ = [
    "tilt",
    "mask_parents",
    "require_values",
    "missing_value_error",
    "fill_discrete",
    "fill_latent",
    "pin",
    "observe_given",
    "name_plate_dims",
    "contain",
    "OUTSIDE_READS",
    "masking",
    "replay_outside",
    "TiltedDistribution",
    "TILT_PREFIX",
    "PLACEHOLDER_KEY",
]

TILT_PREFIX = "_structinfer_tilt:"
"""Prefix of the factor sites [`tilt`][structinfer.handlers.tilt] adds for deterministic sites."""
_PAIR_TILT = "structinfer_pair_tilt"  # a Markov edge's pairwise tilt, added after its value
_DET_TILT = "structinfer_tilt"  # a deterministic site's tilt, added after its value
PLACEHOLDER_KEY = "structinfer_placeholder"
"""Key [`fill_latent`][structinfer.handlers.fill_latent] sets (to `True`) in the `infer`
dict of a site it filled."""


class TiltedDistribution(dist.Distribution):
    r"""``base`` with an extra additive term: $\log p(v) + t[..., v]$ (unnormalised).

    Only used inside the exact engine: the tilt is zero, so the value of
    $\log Z$ is unchanged, but its gradient with respect to ``t`` is the
    posterior marginal of the site.

    Args:
        base: the site's distribution.
        t: the tilt, ``batch + (support,)``.
    """

    # a pytree of both, as NumPyro's scan stacks a step's distributions
    pytree_data_fields = ("base", "t")

    def __init__(self, base: dist.Distribution, t: jax.Array):
        self.base = base
        self.t = t
        super().__init__(batch_shape=base.batch_shape, event_shape=base.event_shape)

    @property
    def support(self) -> dist.constraints.Constraint:
        """The base distribution's support."""
        return self.base.support

    @property
    def has_enumerate_support(self) -> bool:
        """Whether the base distribution can be enumerated."""
        return self.base.has_enumerate_support

    def enumerate_support(self, expand: bool = True) -> jax.Array:
        """The base distribution's support values (see NumPyro's ``enumerate_support``)."""
        return self.base.enumerate_support(expand=expand)

    def sample(self, key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """A draw of the base distribution (the tilt is zero)."""
        return self.base.sample(key, sample_shape)

    def log_prob(self, value: jax.Array) -> jax.Array:
        r"""$\log p(v) + t[..., v]$.

        Args:
            value: values of the site (an enumerated value included).

        Returns:
            The tilted log-probabilities.
        """
        return self.base.log_prob(value) + gather(self.t, value)


@promote_batch_shape.register
def _promote_tilted(d: TiltedDistribution) -> TiltedDistribution:
    # inside a scan, a step's site gains the time dim: so does its batch shape
    new = copy.copy(d)
    new.base = promote_batch_shape(d.base)
    new._batch_shape = new.base.batch_shape
    return new


def _contract(t: jax.Array, v: jax.Array) -> jax.Array:
    """``sum_e t[..., e] v[..., e]`` (broadcast batch dims), as one dot."""
    return jnp.einsum("...e,...e->...", t, v, precision=jax.lax.Precision.HIGHEST)


@jax.custom_jvp
def _event_inner(t: jax.Array, v: jax.Array) -> jax.Array:
    r"""$\langle t, v\rangle$ over the last axis, with the dot skipped when $t = 0$.

    The engine differentiates $\log Z$ at zero tilts, where this term is zero: its value
    is read only through its derivative $\partial_t = v$. At $t = 0$ the forward pass
    returns zeros without computing the ``(enumerated values x children)`` dot, which
    halves the contraction work of an expectation and keeps that dot out of the fused
    softmax that follows it (XLA:CPU's YNNPACK fusion of a dot, a reduction along the
    dot's rows and an in-place elementwise update returned wrong values at
    ``n >= 4096``; see the docs' known issues). Any other $t$ takes the dot.
    """
    shape = jnp.broadcast_shapes(t.shape[:-1], v.shape[:-1])
    dtype = jnp.result_type(t, v)
    return jax.lax.cond(jnp.any(t != 0), *_event_inner_branches(shape, dtype), t, v)


@functools.lru_cache(maxsize=512)
def _event_inner_branches(shape: tuple, dtype):
    """`_event_inner`'s two branches, built once per (shape, dtype): the same function
    objects on every call let JAX reuse ``lax.cond``'s traced branches and, run eagerly,
    its compiled program."""

    def dot(t, v):
        return _contract(t, v).astype(dtype)

    def at_zero(t, v):
        # zero, or NaN where any of v is not finite: 0 * max |v|, one scalar from an
        # O(size of v) reduction, never a constant that XLA would fold. (A zero per row,
        # sum(0 * v, -1), keeps a non-finite value's NaN to its own rows but runs the
        # expectation of a causal head at n = 4097 7x slower on XLA:CPU.)
        return jnp.broadcast_to((0 * jnp.max(jnp.abs(v), initial=0)).astype(dtype), shape)

    return dot, at_zero


def _event_inner_jvp(primals, tangents):
    t, v = primals
    t_dot, v_dot = tangents
    out = _event_inner(t, v)
    # d<t, v> = <dt, v> + <t, dv>; a tangent that is a symbolic zero adds nothing
    tangent = jnp.zeros_like(out)
    if not isinstance(t_dot, SymbolicZero):
        tangent = tangent + _contract(t_dot, v).astype(out.dtype)
    if not isinstance(v_dot, SymbolicZero):
        tangent = tangent + _contract(t, v_dot).astype(out.dtype)
    return out, tangent


_event_inner.defjvp(_event_inner_jvp, symbolic_zeros=True)


class tilt(Messenger):
    r"""Add zero tilts to sites, so that $\partial_t \log Z$ is their posterior mean.

    With ``tilts = {name: (t, event_dim)}``:

    * an enumerated sample site ``name`` with ``t`` of shape ``batch + (support,)``:
      its log-prob gains $t[\ldots, \phi]$, and $\partial \log Z / \partial t$ at $t = 0$
      is the site's posterior marginal;
    * a deterministic site with ``t`` of the value's (non-enumerated) shape and
      ``event_dim`` trailing event dims: a factor $\sum_{\text{event}} t \cdot v$ is added,
      and the gradient is the posterior expectation $\mathbb E[v]$;
    * an edge site with a [`Markov`][structinfer.priors.Markov] prior inside a
      ``numpyro.contrib.control_flow.scan``, with ``t`` of shape
      ``(T,) + batch + (K + 1, K)``: step $s$ gains $t[s, \ldots, \phi_{s-1}, \phi_s]$
      (row $K$ for the first edge, which has no previous one), and the gradient is the
      pairwise posterior $p(\phi_{s-1} = i, \phi_s = j \mid x)$ (summed over $i$: the
      marginal).

    Sites inside a scan body are tilted per step: the scan's body is wrapped so that
    step $s$ sees ``t[s]`` (the stacked sites the scan records afterwards are left alone).

    Args:
        fn: the model (or ``None`` to use as a context manager).
        tilts: ``{site name: (t, event_dim)}``, non-empty.
        max_plate_nesting: the model's plate dims left of the enumeration dims.

    Raises:
        ValueError: if ``tilts`` is empty; at a deterministic site whose value does not
            depend on any edge or has the wrong trailing shape.
    """

    def __init__(
        self,
        fn: Callable | None = None,
        tilts: dict[str, tuple[jax.Array, int]] | None = None,
        max_plate_nesting: int = 0,
    ):
        if not isinstance(tilts, (dict, _StepTilts)) or not tilts:
            raise ValueError("tilt: `tilts` must be a non-empty dict {site: (t, event_dim)}")
        self.tilts = tilts
        self.max_plate_nesting = max_plate_nesting
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        """Wrap a tilted sample site's distribution in a `TiltedDistribution`; tilt a
        scan's steps."""
        name = msg.get("name")
        if msg["type"] == "control_flow":
            self._tilt_steps(msg)
            return
        if msg["type"] == "deterministic" and name in self.tilts and not msg.get(SCAN_RECORD_KEY):
            msg[_DET_TILT] = self.tilts[name]  # read back (under any scope) once it has a value
            return
        if msg["type"] != "sample" or name not in self.tilts or SCAN_INDEX_KEY in msg["infer"]:
            return  # (a site a scan step already tilted, or the scan's stacked record)
        edge = msg["infer"].get(EDGE_INFO_KEY)
        t, _ = self.tilts[name]
        if edge is not None and edge.markov:
            msg["infer"][_PAIR_TILT] = t  # a pairwise factor once the value is known
            return
        msg["fn"] = TiltedDistribution(msg["fn"], t)

    def _tilt_steps(self, msg: dict) -> None:
        """Run a scan's body under this tilt with every tilt sliced at the step index."""
        f, init, xs, length, reverse = msg["args"]
        if length is None:
            length = jnp.shape(jax.tree.leaves(xs)[0])[0]
        tilts, nesting = self.tilts, self.max_plate_nesting

        def step(carry, x_s):
            x, s = x_s
            with tilt(tilts=_StepTilts(tilts, s), max_plate_nesting=nesting):
                return f(carry, x)

        msg["args"] = (step, init, (xs, jnp.arange(length)), length, reverse)

    def postprocess_message(self, msg: dict) -> None:
        """Add the factor of a tilted deterministic site, or of a Markov edge's pair."""
        name = msg.get("name")
        t = msg["infer"].pop(_PAIR_TILT, None) if msg["type"] == "sample" else None
        if t is not None:
            edge = msg["infer"][EDGE_INFO_KEY]
            k = edge.num_parents
            prev = jnp.where(edge.previous < 0, k, edge.previous)
            potential(TILT_PREFIX + edge.name, Vindex(t)[..., prev, msg["value"]],
                      maskable=False)
            return
        spec = msg.pop(_DET_TILT, None) if msg["type"] == "deterministic" else None
        if spec is None:
            return
        t, event_dim = spec
        v = jnp.asarray(msg["value"])
        shown = user_site_name(name)
        if event_dim:
            ev_shape, ev_ref = v.shape[-event_dim:], t.shape[-event_dim:]
            if ev_shape != ev_ref:
                raise ValueError(
                    f"deterministic site '{shown}': under enumeration its value has trailing "
                    f"shape {ev_shape} where {ev_ref} was expected — record the value inside "
                    "the plates of the children it depends on, and index parent tables with "
                    "structinfer.gather / numpyro.ops.indexing.Vindex"
                )
        lead = v.ndim - event_dim - self.max_plate_nesting
        if lead <= 0:
            raise ValueError(
                f"deterministic site '{shown}': under enumeration its value (shape "
                f"{v.shape}) has no dims left of its plates, where an edge's enumerated "
                "value puts its parents: either it depends on no edge site (it is the same "
                "under every structure, with no posterior expectation to compute: use the "
                "value directly), or an index, sum or reshape over those leading dims "
                "removed them (e.g. values[j][0] outside the plate, which reads the first "
                "enumerated parent). Record a value read from an edge inside the plate of "
                "its children, index parent tables with structinfer.gather / "
                "numpyro.ops.indexing.Vindex, and reduce over trailing dims only"
            )
        if event_dim:
            # <t, v> over the event dims as one contraction: never the broadcast product,
            # which is (enumerated values x children x event) for a value read at an edge
            flat = lambda x: jnp.reshape(x, x.shape[: x.ndim - event_dim] + (-1,))  # noqa: E731
            term = _event_inner(flat(t), flat(v))
        else:
            term = t * v
        # unmasked: a mask around the value must not drop its expectation
        potential(TILT_PREFIX + name, term, maskable=False)


class _StepTilts:
    """The tilts of one scan step: a site's tilt is sliced at the step when the step
    looks it up, so the tilts of sites outside the scan (any shape) are never sliced."""

    def __init__(self, tilts, s):
        self._tilts, self._s = tilts, s

    def __bool__(self) -> bool:
        return bool(self._tilts)

    def __contains__(self, name) -> bool:
        return name in self._tilts

    def __getitem__(self, name):
        t, ev = self._tilts[name]
        return t[self._s], ev


_MASKING: contextvars.ContextVar[int] = contextvars.ContextVar("structinfer_masking", default=0)


def masking() -> bool:
    """Whether a [`mask_parents`][structinfer.handlers.mask_parents] handler is active here.

    Code that answers a call from a trace cached without the handlers around it (the
    lowering's ``jit``) checks this first: an edge it runs would take that handler's mask.

    Returns:
        ``True`` inside a ``mask_parents`` (entered and not exited), else ``False``.
    """
    return _MASKING.get() > 0


class mask_parents(Messenger):
    r"""Restrict every edge site in scope to the parents a boolean mask allows.

    $$
    p(\phi_i = j) \;\to\; \frac{M_{ij}\, p(\phi_i = j)}{\sum_{j'} M_{ij'}\, p(\phi_i = j')}
    $$

    Each [`edge`][structinfer.edge] site under the handler takes the
    [`Masked`][structinfer.priors.Masked] prior of its own prior and ``mask``: a key
    padding mask (keys past a sequence's end) or an attention mask added to a model
    written without one, as a boolean mask restricts the softmax of transformer
    attention (Vaswani et al. 2017, sec. 3.2.3). Nested handlers intersect their masks.
    [`structinfer.nn.Attention`][structinfer.nn.Attention]'s ``mask`` argument is this
    handler around its mechanism.

    Args:
        fn: the model (or ``None`` to use as a context manager).
        mask: boolean, ``True`` where a parent is allowed, broadcasting against each
            edge's ``(..., children, parents)`` table (``(..., 1, parents)``: one mask per
            parent, the same for every child). May be traced.

    Raises:
        TypeError: (at an edge site) a non-boolean mask.
        ValueError: (at an edge site) a mask whose last axis is not the edge's parents, that
            does not fit its plates, that leaves a child no parent (on concrete values),
            or a Markov edge (its parents are the chain's states); (when the wrapped code
            returns) no edge site ran under the handler, so the mask restricted nothing.

    Examples:
        ```python
        import jax.numpy as jnp
        import numpyro
        import structinfer as si

        def model(q, k):
            with numpyro.plate("queries", q.shape[0]):
                si.edge("phi", si.priors.Uniform(k.shape[0]), si.scores.Dot(q, k))

        q, k = jnp.ones((2, 3)), jnp.ones((4, 3))
        keep = jnp.array([True, True, True, False])  # the last key is padding
        attn = si.marginals(si.handlers.mask_parents(model, mask=keep), q, k)["phi"]
        assert jnp.allclose(attn, jnp.array([1 / 3, 1 / 3, 1 / 3, 0.0]))
        ```
    """

    def __init__(self, fn: Callable | None = None, mask: jax.Array | None = None):
        if mask is None:
            raise TypeError("mask_parents: mask= is required (boolean, True where a parent "
                            "is allowed)")
        self.mask = mask
        self._consults = 0  # edge sites that read the mask, over every run
        self._starts: list[int] = []  # `_consults` at each (possibly nested) entry
        super().__init__(fn)

    def __enter__(self):
        self._starts.append((self._consults, _MASKING.set(_MASKING.get() + 1)))
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        start, token = self._starts.pop()
        _MASKING.reset(token)
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None and self._consults == start:
            raise ValueError(
                "mask_parents: no edge site consulted this handler: the code it wrapped "
                "ran no structinfer.edge that saw it, so the mask restricted nothing. Wrap "
                "the model (or the part of it) that declares the edge sites; inside a "
                "numpyro scan, wrap the step (its edges do not see handlers outside the "
                "scan); around a jitted function, put the handler inside it (a call that "
                "jax answers from its cache runs no model)"
            )

    def process_message(self, msg: dict) -> None:
        """Add the mask to an edge site's list (`parent_masks`)."""
        if msg["type"] == MASK_PARENTS_TYPE:
            if msg["name"].startswith("_PREV_"):
                # NumPyro's scan renames its first, unrolled step's sites and hides the
                # later steps from handlers outside it: only that step would be masked
                raise ValueError(
                    f"edge site '{user_site_name(msg['name'])}': mask_parents "
                    "outside a numpyro scan reaches the scan's first step only; put the "
                    "handler inside the step function")
            msg["masks"].append(self.mask)
            self._consults += 1


class _SeesEveryEdge(Messenger):
    """A handler of the exact engine that every edge site must reach: while it is active
    (`ENGINE_DEPTH`), an edge that a ``numpyro.handlers.block`` hides from it is refused
    where it is sampled; an edge of a scan step (which NumPyro hides while the step runs
    and replays after the loop, `STEP_EDGES`) is refused when the handler exits if its
    replay never reached it (a block around the scan)."""

    def __enter__(self):
        pending: set[str] = set()  # edges of scan steps, to be seen when replayed
        depth = ENGINE_DEPTH.set(ENGINE_DEPTH.get() + 1)
        steps = STEP_EDGES.set((*STEP_EDGES.get(), pending))
        self.__dict__.setdefault("_frames", []).append((depth, steps, pending, set()))
        return super().__enter__()

    def __exit__(self, exc_type, *exc):
        depth, steps, pending, seen = self._frames.pop()
        try:
            out = super().__exit__(exc_type, *exc)
        finally:
            STEP_EDGES.reset(steps)
            ENGINE_DEPTH.reset(depth)
        missing = sorted(pending - seen)
        if exc_type is None and missing:  # a block around a scan hid its replayed edges
            raise hidden_edge_error(missing[0])
        return out

    def process_message(self, msg: dict) -> None:
        """Mark an edge site seen; refuse a scan over no steps, a Markov edge in a scan
        whose ``history`` is not 1 or whose step returns a carry that is not the edge, and
        a factor in a scan whose ``history`` is above 1."""
        if msg["type"] == "control_flow" and len(msg["args"]) == 5:  # a scan
            _, _, xs, length, _ = msg["args"]
            leaves = jax.tree.leaves(xs)
            if (length if length is not None else jnp.shape(leaves[0])[0] if leaves
                    else None) == 0:
                raise ValueError(
                    "numpyro.contrib.control_flow.scan over 0 steps (its xs have a leading "
                    "dim of 0): NumPyro's enumeration of a scan needs one step at least; "
                    "leave the scan out of the model when there are no steps"
                )
            _checked_steps(msg)
            return
        if msg["type"] == "sample":
            holder = (msg.get("infer") or {}).get(EDGE_SEEN_KEY)
            if holder is not None:
                holder["seen"] = True
                if self._frames:
                    self._frames[-1][3].add(holder.get("name"))


def _checked_steps(msg: dict) -> None:
    """Wrap a scan's body so that its Markov edges are checked as the step runs.

    A Markov edge in a scan whose ``history`` is not 1 raises: the chain is first order,
    and NumPyro's enumeration of a scan with another ``history`` is not that chain
    (``history=0`` runs the steps as a plate; ``history=2`` let a step read the edge two
    steps back, whose factor the contraction then summed wrongly). With ``history`` above
    1 a factor site raises too: NumPyro's ``factor`` fails there, and a
    [`potential`][structinfer.primitives.potential] reading the site two steps back gave
    a wrong log Z. Under enumeration a ``numpyro.factor`` in a step raises naming it:
    NumPyro's ``Unit`` keeps its batch shape when the scan stacks the steps, so the
    enumerated scan fails on it (a bare ``AssertionError``, a left-over dim or a
    broadcasting error); a [`potential`][structinfer.primitives.potential] is the same
    factor with its time dim. A step with a Markov edge must return a carry of the shape
    and dtype it took (`_check_carry`). The checks read shapes only, once per trace of
    the step."""
    f, *rest = msg["args"]
    history = msg["kwargs"].get("history", 1)

    def step(carry, x):
        with numpyro_trace() as sites:
            out = f(carry, x)
        chain = None  # the step's first Markov edge site
        for name, site in sites.items():
            name = user_site_name(name)  # for the messages: the first steps run unrolled
            if msg["kwargs"].get("enum") and _is_plain_factor(site):
                raise ValueError(
                    f"factor site '{name}' is a numpyro.factor inside a "
                    "numpyro.contrib.control_flow.scan, whose enumeration loses its time "
                    "dim (NumPyro's Unit does not grow a batch dim when the scan stacks the "
                    f"steps): write it as structinfer.primitives.potential('{name}', "
                    "log_factor), the same factor, one per step"
                )
            edge = (site.get("infer") or {}).get(EDGE_INFO_KEY)
            is_markov = site["type"] == "sample" and edge is not None and edge.markov
            if is_markov and history != 1:
                raise ValueError(
                    f"edge site '{name}': a Markov edge's scan must have history=1 (each "
                    f"step reads the previous edge only), got history={history}: a chain "
                    "of Markov edges is first order"
                )
            if history > 1 and is_factor(site):
                raise ValueError(
                    f"factor site '{name}' is inside a scan with history={history}: the "
                    "exact engine does not contract a factor in a scan whose steps see "
                    "more than the previous one (write the dependence as a sample site's "
                    "distribution, or use history=1)"
                )
            if is_markov and chain is None:
                chain = site
        if chain is not None and isinstance(out, tuple) and len(out) == 2:
            # the enumeration flag is set by NumPyro's enum handler on this message by the
            # time the step runs (it may sit outside this handler)
            _check_carry(chain, carry, out[0], enumerated=bool(msg["kwargs"].get("enum")))
        return out

    msg["args"] = (step, *rest)


def _is_plain_factor(site: dict) -> bool:
    """Whether a step's site is NumPyro's own ``Unit`` (a ``numpyro.factor``, however a
    plate or a mask wraps it), not a [`Potential`][structinfer.primitives.Potential]."""
    if not is_factor(site):
        return False
    fn = site["fn"]
    while not isinstance(fn, dist.distribution.Unit):
        fn = fn.base_dist  # is_factor found a Unit under these wrappers
    return not isinstance(fn, Potential)


def _check_carry(site: dict, took, returned, enumerated: bool) -> None:
    """Refuse a carry that a Markov chain's step returns changed from the one it took,
    naming the edge ``site`` (JAX's scan and NumPyro's enumerated scan fail on it with
    errors that name neither the site nor the cause).

    Without enumeration each leaf must keep its shape and dtype (a weakly typed leaf may
    change dtype: JAX promotes it). Under enumeration NumPyro's scan gives each step's
    edge its own enumeration dim and reshapes the carry back, so a leaf must keep its
    size: one computed from two steps' edges (``previous + z``) has both dims. The first,
    unrolled steps of an enumerated scan (a concrete scan index) take the plain start
    and are not compared."""
    edge = site["infer"][EDGE_INFO_KEY].name
    if enumerated and not isinstance(site["infer"].get(SCAN_INDEX_KEY), jax.core.Tracer):
        return
    took_leaves, took_tree = jax.tree_util.tree_flatten_with_path(took)
    returned_leaves, returned_tree = jax.tree.flatten(returned)
    if took_tree != returned_tree:
        raise ValueError(
            f"edge site '{edge}': the scan's step returns a carry of structure "
            f"{returned_tree}, but it took {took_tree}: the carry keeps its structure "
            "from step to step, and holds the edge's value where the step reads previous="
        )
    for (path, a), b in zip(took_leaves, returned_leaves):
        ta, tb = jnp.asarray(a), jnp.asarray(b)  # shape, dtype, size, weak_type (traced too)
        where = "carry" + jax.tree_util.keystr(path)
        if enumerated and ta.size != tb.size:
            raise ValueError(
                f"edge site '{edge}': the scan's carry is not the edge's value: {where} has "
                f"shape {tb.shape} under enumeration where the carry the step took had "
                f"shape {ta.shape} ({tb.size} entries for {ta.size}; each step's edge "
                "takes an enumeration dim on the left). A Markov chain's carry holds the "
                "edge itself as the step draws it (return z, or a tuple holding z), not a "
                "value computed from it and the previous carry (such as previous + z)"
            )
        if (not enumerated and ta.shape != tb.shape) or (ta.dtype != tb.dtype
                                                           and not ta.weak_type):
            raise ValueError(
                f"edge site '{edge}': the scan's step changes its carry: {where} has shape "
                f"{tb.shape} and dtype {tb.dtype}, but it took shape {ta.shape} and dtype "
                f"{ta.dtype}: the carry keeps its shape and dtype from step to step, "
                "and a Markov chain's carry holds the edge's value as the step draws it "
                f"(integer, of the plates' batch shape {tuple(jnp.shape(site['value']))})"
            )


class require_values(_SeesEveryEdge):
    """Raise a clear error at a latent, non-enumerated sample site that has no value.

    Args:
        fn: the model (or ``None`` to use as a context manager).
        what: who needs the values, for the error message.

    Raises:
        ValueError: at the first latent continuous site without a value, naming it; at an
            edge site that a ``numpyro.handlers.block`` hides (nothing outside the block
            sees it to sum it out).
    """

    def __init__(self, fn: Callable | None = None, what: str = "the exact engine"):
        self.what = what
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        """Check one sample site (and see every edge: refuse one hidden by a block)."""
        super().process_message(msg)
        if msg["type"] != "sample" or msg["is_observed"] or msg.get("value") is not None:
            return
        if is_enumerated(msg) and msg["fn"].has_enumerate_support:
            return
        raise missing_value_error(msg["name"], self.what)


def missing_value_error(site: str, what: str = "the exact engine") -> ValueError:
    """The error [`require_values`][structinfer.handlers.require_values] raises at ``site``.

    Args:
        site: the latent, non-enumerable sample site without a value.
        what: who needs the values.

    Returns:
        The ``ValueError`` naming the site and what to do.
    """
    return ValueError(
        f"sample site '{site}' is latent and not enumerable, so {what} "
        "cannot collapse it: give it a value with numpyro.handlers.substitute / "
        "condition (e.g. a posterior draw), or mark a discrete site with "
        "infer={'enumerate': 'parallel'}"
    )


class fill_discrete(Messenger):
    """Give each enumerable site a placeholder value (zeros of its batch shape).

    Wraps a model like any NumPyro handler: ``fill_discrete(model)``.
    """

    def process_message(self, msg: dict) -> None:
        """Fill one enumerable sample site that has no value."""
        if msg["type"] == "sample" and msg.get("value") is None and not msg["is_observed"]:
            if is_enumerated(msg) and msg["fn"].has_enumerate_support:
                msg["value"] = jnp.zeros(msg["fn"].batch_shape, dtype=jnp.int32)


def _float_dtype(fn) -> jnp.dtype:
    """The floating dtype of a distribution's parameters (what its draws would have)."""
    try:
        leaves = [x for x in jax.tree.leaves(fn) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    except Exception:  # noqa: BLE001 - a distribution that is not a pytree: the default
        leaves = []
    return jnp.result_type(*leaves) if leaves else jnp.result_type(float)


def _placeholder(fn: dist.Distribution, sample_shape: tuple[int, ...] = ()) -> jax.Array:
    r"""A value of `fn`'s shape inside its support, computed without sampling: $T(0)$ with
    $T$ = `biject_to(support)`. Discrete supports, and supports with no bijection, get
    zeros.

    Args:
        fn: the site's distribution (already expanded by its plates).
        sample_shape: the site's extra leading sample shape.

    Returns:
        An array of shape ``sample_shape + fn.batch_shape + fn.event_shape``.
    """
    shape = tuple(sample_shape) + tuple(fn.batch_shape) + tuple(fn.event_shape)
    support = fn.support
    if support.is_discrete:
        return jnp.zeros(shape, jnp.int32)
    dtype = _float_dtype(fn)
    try:
        t = biject_to(support)
        value = t(jnp.zeros(t.inverse_shape(shape), dtype))
    except (NotImplementedError, TypeError, ValueError):
        return jnp.zeros(shape, dtype)
    return jnp.broadcast_to(value, shape)


class fill_latent(_SeesEveryEdge):
    """Give each unvalued latent site that is not enumerable a placeholder in its support.

    The site is marked with `infer[PLACEHOLDER_KEY] = True`. The placeholder is $T(0)$ with $T$ = `biject_to(support)` (the image of the
    unconstrained origin: 1 for a positive site, the uniform point of a simplex); it is
    never a draw, so no sampler is traced. Reading a model's sites and shapes before it
    is fitted needs no real values; computing with them does, which
    [`require_values`][structinfer.handlers.require_values] enforces. An edge site that a
    ``numpyro.handlers.block`` hides is refused here too, as there.
    """

    def process_message(self, msg):
        """Fill one latent site (and see every edge: refuse one hidden by a block)."""
        super().process_message(msg)
        if msg["type"] != "sample" or msg["is_observed"] or msg.get("value") is not None:
            return
        if is_enumerated(msg) and msg["fn"].has_enumerate_support:
            return
        msg["value"] = _placeholder(msg["fn"], tuple(msg["kwargs"].get("sample_shape", ())))
        msg["infer"] = {**(msg.get("infer") or {}), PLACEHOLDER_KEY: True}


class pin(Messenger):
    """Fix discrete sites to given values and take them out of enumeration.

    The values are observations: their log-prob is kept. Used for single-parent edge
    sites, which funsor's MAP / sampling cannot read a point from.

    Args:
        fn: the model (or ``None`` to use as a context manager).
        data: ``{site name: value}``.
    """

    def __init__(self, fn: Callable | None = None, data: dict | None = None):
        self.data = dict(data or {})
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        """Observe one listed sample site at its value."""
        if msg["type"] == "sample" and msg["name"] in self.data:
            msg["value"] = self.data[msg["name"]]
            msg["is_observed"] = True
            msg["infer"] = {k: v for k, v in msg["infer"].items() if k != "enumerate"}


class observe_given(Messenger):
    r"""Observe every enumerable site that already has a value when it reaches this handler.

    An [`edge`][structinfer.edge] (or another site marked for enumeration) given a value
    by ``numpyro.handlers.substitute`` is fixed at that value, as
    ``numpyro.handlers.condition`` fixes it: its log-probability is kept and nothing is
    summed over it, so $\log Z$ is the joint density at the given structure. (NumPyro's
    own enumeration would replace the value by the whole support.) Like
    [`pin`][structinfer.handlers.pin], it takes the site out of enumeration. The engine
    wraps a model in it before anything of its own, so the values it substitutes itself
    (edge probes) are not affected. The sites of a ``scan``'s steps (a
    [`Markov`][structinfer.priors.Markov] chain's edges) take their values from the scan,
    which applies the handlers given inside this one to each step: a ``substitute`` of
    given values there becomes a ``condition`` of them.
    """

    def process_message(self, msg: dict) -> None:
        """Mark one valued enumerable sample site observed (a scan's steps: see above)."""
        if msg["type"] == "control_flow":
            stack = msg["kwargs"].get("substitute_stack")
            if stack:
                stack[:] = [("condition", data) if kind == "substitute"
                            and isinstance(data, dict) else (kind, data)
                            for kind, data in stack]
            return
        if msg["type"] != "sample" or msg.get("value") is None:
            return
        if SCAN_INDEX_KEY in msg["infer"]:
            return  # a site of a scan's steps: the scan gave its value, not the model
        if is_enumerated(msg) and msg["fn"].has_enumerate_support:
            msg["is_observed"] = True
        if msg["is_observed"] and "enumerate" in msg["infer"]:
            # as `pin` (a conditioned edge too): funsor's infer_discrete reads every site
            # marked for enumeration, observed or not
            msg["infer"] = {k: v for k, v in msg["infer"].items() if k != "enumerate"}


_ENUMERATING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "structinfer_enumerating", default=None)  # the model an active contain enumerates

# (not ``prng_key``: the engine runs a model several times, and a seed around the call
# would give each run another key)
_PASSED_ON = frozenset({"param", "mutable", MASK_PARENTS_TYPE})
_MASKS_INSIDE = "structinfer_masks_inside"  # (key, handler id): a mask message's mask
# count and its edge's name when it left that contain handler

OUTSIDE_READS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "structinfer_outside_reads", default=None)
"""While set to a list, [`contain`][structinfer.handlers.contain] appends to it the name of
each message whose answer can come from the handlers around the engine call: a ``param``
or ``mutable`` site, and an edge's parent-mask message that a handler outside answered.
A caller that caches a traced model run (the lowering's ``jit``) must not reuse
it for a model that reads them: the answer depends on handlers the cache key cannot see."""


class name_plate_dims(Messenger):
    r"""Name each plate's tensor dim of an enumerated trace as the plate its sites record.

    ``numpyro.handlers.scope`` renames the plates of the sites inside it (``"l1/queries"``)
    while NumPyro's funsor enumeration names the plate's tensor dim after the plate itself
    (``"queries"``); the contraction multiplies out the plates the sites record, so the
    dim would be left over. This handler renames the dim in each sample site's
    ``dim_to_name`` (and ``name_to_dim``) to the site's plate, so layers composed with
    ``scope`` are collapsed as the independent products over their children they are.
    Put it directly around the enumerated model given to NumPyro's funsor ``trace`` (its
    ``postprocess_message`` runs after the trace annotates the site).

    A ``scope`` around a ``numpyro.contrib.control_flow.scan`` whose step enumerates a
    site (a Markov edge) cannot be collapsed: the scan records its step's sites after the
    step ran, so the scope renames the site (``"l1/z"``) but not the dims NumPyro's
    enumeration named after the step's own names (``"z"``, ``"_PREV_z"``), by which its
    contraction looks the sites up (NumPyro's own ``log_density`` fails with
    ``KeyError: 'z'``). The handler refuses it when the scan records the site, naming it
    and the fix: the scope inside the step, ``scan(scope(step, prefix), init, xs)``.

    The same ``scope`` hides a ``scan``'s (or a ``cond``'s) sites from the handlers
    outside it that give values: ``substitute``, ``condition`` and ``replay`` hand their
    values to the scan, which looks them up by the step's own site names (``"x"``), while
    the handlers hold them under the scope's (``"l1/x"``). A continuous site of such a
    step was then never given its value: NumPyro's potential drew it without a key (a bare
    ``AssertionError``) or, under a ``seed``, at random (a potential that ignores the
    sampler's value). This handler learns the prefix the scopes between the control flow
    and itself add (a probe message sent through them, stopped here) and gives the scan
    the values of the handlers around it under the step's names too: a dict's keys with
    the prefix also without it, a callable (an init strategy, NumPyro's unconstraining
    function) the step's site under its scoped name. Put it around the whole model (as
    the engine, `si.infer.NUTS` and `si.infer.hide_edges` do): a model with no scope
    around a control flow is left as it is.

    Raises:
        ValueError: an enumerated site of a scan step renamed by a handler around the
            scan (``numpyro.handlers.scope``).
    """

    _scan_sites: dict | None = None  # id(message) -> (message, its name in the step)
    _time_names: dict | None = None  # id(message) -> (message, {time dim: its name})

    def process_message(self, msg: dict) -> None:
        if msg["type"] == _SCOPE_PROBE:
            if msg.get("structinfer_stop_at") is self:
                msg["structinfer_reached"] = True
                msg["stop"] = True
            return
        if msg["type"] == "control_flow":
            _give_values_through_scopes(msg, self)
            return
        seen = self._scan_sites.pop(id(msg), None) if self._scan_sites else None
        if seen is None or seen[0] is not msg or msg.get("name") == seen[1]:
            return
        raise ValueError(
            f"site '{seen[1]}' of a numpyro.contrib.control_flow.scan step is recorded as "
            f"'{msg.get('name')}' by a handler around the scan (numpyro.handlers.scope): "
            "NumPyro's enumeration of a scan names its dims after the step's own site names "
            f"('{seen[1]}', '_PREV_{seen[1]}'), so it cannot contract the renamed sites (it "
            f"fails with KeyError: '{seen[1]}'). Put the scope inside the step instead, "
            "scan(numpyro.handlers.scope(step, prefix), init, xs), or give the step's sites "
            "the prefix in their names"
        )

    def postprocess_message(self, msg: dict) -> None:
        if msg["type"] == "control_flow":
            self._scan_sites = _enumerated_scan_sites(msg)
            self._time_names = _scan_time_names(msg)
            return
        names = (msg.get("infer") or {}).get("dim_to_name") if msg["type"] == "sample" else None
        if not names:
            return
        renamed = False
        kept = self._time_names.pop(id(msg), None) if self._time_names else None
        if kept is not None and kept[0] is msg:
            for dim, name in kept[1].items():
                if names.get(dim) != name:
                    names[dim] = name  # the scan's time dim, named after a site outside it
                    renamed = True
        for frame in msg.get("cond_indep_stack") or []:
            own = names.get(frame.dim) if frame.dim is not None else None
            if own is not None and own != frame.name and frame.name.endswith(own):
                names[frame.dim] = frame.name  # a prefix added by scope
                renamed = True
        if renamed:
            msg["infer"]["name_to_dim"] = {name: dim for dim, name in names.items()}


def _scan_step_trace(msg: dict) -> dict | None:
    """A ``scan`` control-flow message's step trace ``{name: site}`` (NumPyro 0.15-0.22's
    value layout, ``((length, key, carry), (PytreeTrace, ys))``), or ``None`` (another
    control flow or layout: the callers then leave the message as it is)."""
    try:
        steps = msg.get("value")[1][0].trace
    except (TypeError, IndexError, AttributeError, KeyError):
        return None
    return steps if isinstance(steps, dict) else None


def _scan_time_names(msg: dict) -> dict | None:
    """``{id(site): (site, {dim: name})}``: the time dim NumPyro's enumerated ``scan``
    gave each sample site of its steps (``"_time_<first site>"``, the site's leftmost batch
    dim), read before the sites are sent on. NumPyro's funsor ``trace`` then names each
    dim of a site again from the dims allocated so far; where an enumerated site before
    the scan holds that dim (an edge before a scan whose step has a plate), the time dim
    took that site's name, and the contraction summed the steps against it (a wrong log Z,
    or funsor's ``Output mismatch``)."""
    steps = _scan_step_trace(msg) if msg["kwargs"].get("enum") else None
    if steps is None:
        return None
    out = {}
    for site in steps.values():
        if not isinstance(site, dict) or site.get("type") != "sample":
            continue
        names = (site.get("infer") or {}).get("dim_to_name") or {}
        time = {d: n for d, n in names.items() if isinstance(n, str) and n.startswith("_time_")}
        if time:
            out[id(site)] = (site, time)
    return out or None


def _enumerated_scan_sites(msg: dict) -> dict | None:
    """``{id(site): (site, its name in the step)}`` of a ``scan`` whose step has an
    enumerated site: the messages the scan sends on next (``None`` for another control
    flow, or a step with none)."""
    steps = _scan_step_trace(msg)
    if steps is None:
        return None
    # the enumerated sites only: the refusal names one of them (a continuous site of the
    # step is given its values through the scope, `_give_values_through_scopes`)
    return {id(site): (site, name) for name, site in steps.items()
            if isinstance(site, dict) and is_enumerated(site)} or None


_THROUGH_SCOPES = "_structinfer_through_scopes"  # marks a control flow's wrapped fn
_SCOPE_PROBE = "structinfer_scope_probe"  # a message type no NumPyro handler acts on
_PROBE_NAME = "structinfer_probe"


def _scope_prefix(handler: Messenger) -> str | None:
    """The prefix the handlers between a control flow and ``handler`` add to a site name
    (``numpyro.handlers.scope``: ``"l1/"``): a probe message sent through the stack from
    the control flow, renamed on its way and stopped at ``handler``. ``None`` where it
    does not reach ``handler`` (a ``block`` between them)."""
    probe = {"type": _SCOPE_PROBE, "name": _PROBE_NAME, "fn": None, "args": (),
             "kwargs": {}, "value": _SCOPE_PROBE, "infer": {}, "is_observed": False,
             "scale": None, "cond_indep_stack": [], "structinfer_stop_at": handler}
    apply_stack(probe)
    name = probe.get("name") or ""
    if not probe.get("structinfer_reached") or not name.endswith(_PROBE_NAME):
        return None
    return name[: -len(_PROBE_NAME)]


def _give_values_through_scopes(msg: dict, handler: Messenger) -> None:
    """Wrap a control-flow message's function (NumPyro's ``scan_wrapper`` or
    ``cond_wrapper``) where scopes between it and ``handler`` rename its sites, so that,
    when it runs (after every handler has added its values to the message's
    ``substitute_stack``), each entry is also read under the step's own site names
    (`_unscoped_entry`)."""
    fn = msg.get("fn")
    stack = msg["kwargs"].get("substitute_stack")
    if fn is None or stack is None or getattr(fn, _THROUGH_SCOPES, False):
        return
    prefix = _scope_prefix(handler)
    if not prefix:
        return
    inner = len(stack)  # the entries of handlers inside `handler`; the rest are outside

    @functools.wraps(fn)
    def run(*args, **kwargs):
        given = kwargs.get("substitute_stack")
        if given:
            kwargs["substitute_stack"] = [
                (kind, _unscoped_entry(kind, data, prefix, outside=i >= inner))
                for i, (kind, data) in enumerate(given)]
        return fn(*args, **kwargs)

    setattr(run, _THROUGH_SCOPES, True)
    msg["fn"] = run


def _unscoped_entry(kind: str, data, prefix: str, outside: bool):
    """One ``substitute_stack`` entry (a ``substitute`` / ``condition`` dict or callable,
    a ``replay`` trace) read under a step's own site names: a dict also holds each of its
    values whose key starts with ``prefix`` under the key without it (the value a
    handler gives the scoped site wins over one it gives a site of the step's own name);
    a callable of a handler outside ``handler`` (an init strategy, NumPyro's
    unconstraining ``substitute_fn``) is called with the step's site under its scoped
    name. A callable of a handler inside is left as it is (the scopes between it and the
    control flow are not known)."""
    if callable(data) and not isinstance(data, dict):
        return functools.partial(_call_scoped, data, prefix) if outside else data
    n = len(prefix)
    if kind == "replay":  # a trace: its sites carry their names too
        stripped = {k[n:]: {**site, "name": k[n:]} for k, site in data.items()
                    if k.startswith(prefix)}
    else:
        stripped = {k[n:]: v for k, v in data.items() if k.startswith(prefix)}
    return {**data, **stripped} if stripped else data


def _call_scoped(fn: Callable, prefix: str, site: dict):
    """``fn`` (an init strategy, NumPyro's unconstraining ``substitute_fn``) at a step's
    site under the name the scopes around the control flow give it."""
    return fn({**site, "name": prefix + site["name"]})


def _stays_inside(msg: dict) -> bool:
    """A message of the model's own sites, or a parameter the model gave a value itself
    (a ``substitute`` inside it): ``contain`` stops it."""
    if msg["type"] in ("param", "mutable"):
        return msg.get("value") is not None
    return msg["type"] not in _PASSED_ON


class contain(block):
    r"""Keep a model's sites inside the engine call that runs it.

    The exact engine and the lowering run the model they are given under handlers of their
    own and return numbers, not sites. Called inside an outer NumPyro model
    (``numpyro.factor("z", si.log_marginal(inner, x))``, attention inside a model that
    NUTS samples), the inner model's sample, plate, deterministic and factor messages would
    otherwise reach the outer model's handlers: its ``trace`` would record the enumerated
    edges and ``log_density`` score them again, or refuse a second call's sites as
    duplicates. This ``numpyro.handlers.block`` stops them, and passes on the messages
    that belong to the handlers around the call:

    * ``param`` (and ``mutable``) messages, so a ``substitute`` around the
      outer model (SVI, ``log_density``) sets and fits the inner model's parameters (a
      parameter the model gave a value itself, by a ``substitute`` inside it, stays
      inside);
    * the parent-mask message of each [`edge`][structinfer.edge], so a
      [`mask_parents`][structinfer.handlers.mask_parents] around the call restricts its
      edges.

    Handlers that should act on the inner model's own sites (``condition``, ``scale``,
    ``mask``) wrap the model that is passed in. Each message that passed on and may have
    been answered outside is recorded in [`OUTSIDE_READS`][structinfer.handlers.OUTSIDE_READS].

    NumPyro's enumeration does not nest (its enumeration dims and plates are global): a
    run that enumerates names its model in ``enumerates``, and one entered while another
    is active raises.

    Args:
        fn: the model (or ``None`` to use as a context manager).
        enumerates: the name of the model, when the run enumerates its edges.

    Raises:
        ValueError: (on entry) ``enumerates`` is given while another enumerating run is
            active: an exact call inside a model the exact engine is enumerating.
    """

    def __init__(self, fn: Callable | None = None, *, enumerates: str | None = None):
        self.values: dict[str, object] = {}  # param / mutable site -> value it came back with
        self.masks: dict[str, list] = {}  # edge site -> masks added outside
        self.enumerates = enumerates
        self._tokens: list = []
        super().__init__(fn, hide_fn=_stays_inside)

    def __enter__(self):
        if self.enumerates is not None:
            outer = _ENUMERATING.get()
            if outer is not None:
                raise ValueError(
                    f"model '{self.enumerates}' is given to an exact call (log_marginal, "
                    f"marginals, expectation, map_edges, sample_edges) inside model "
                    f"'{outer}', which the exact engine is enumerating: NumPyro's "
                    "enumeration does not nest. Compute the inner result outside and pass "
                    "it to the model, or use a lowered si.attention for the inner call "
                    "(its kernels do not enumerate)")
        self._tokens.append(_ENUMERATING.set(self.enumerates or _ENUMERATING.get()))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ENUMERATING.reset(self._tokens.pop())

    def process_message(self, msg: dict) -> None:
        """Stop a message of the model's own sites; note one that goes on."""
        super().process_message(msg)
        if msg.get("stop"):
            return
        if msg["type"] == MASK_PARENTS_TYPE:  # its name is dropped before postprocessing
            msg[(_MASKS_INSIDE, id(self))] = (len(msg["masks"]), msg["name"])
        elif msg["type"] in _PASSED_ON:
            _note_outside_read(msg.get("name") or msg["type"])

    def postprocess_message(self, msg: dict) -> None:
        """Record a parameter's value and the masks handlers outside added to an edge."""
        if msg["type"] in ("param", "mutable"):
            self.values[msg["name"]] = msg["value"]
        elif msg["type"] == MASK_PARENTS_TYPE and (_MASKS_INSIDE, id(self)) in msg:
            inside, name = msg.pop((_MASKS_INSIDE, id(self)))
            if len(msg["masks"]) > inside:
                self.masks[name] = msg["masks"][inside:]
                _note_outside_read(name)


class replay_outside(Messenger):
    r"""Give a model's parameters and edges what the handlers around a call answered.

    Replays, from a [`contain`][structinfer.handlers.contain] handler a first run passed
    through, each ``param`` / ``mutable`` site's value and the parent masks that
    [`mask_parents`][structinfer.handlers.mask_parents] handlers outside added to each
    edge. For code that runs the model where those handlers cannot reach it (NumPyro's
    ``infer_discrete`` enumerates under a ``block``), so that every run sees the same
    parameters and masks.

    Args:
        fn: the model (or ``None`` to use as a context manager).
        outside: the ``contain`` handler of the first run.
    """

    def __init__(self, fn: Callable | None = None, outside: contain | None = None):
        if not isinstance(outside, contain):
            raise TypeError("replay_outside: outside= must be the contain handler of a run")
        self.outside = outside
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        """Set a recorded parameter's value; add an edge's recorded masks."""
        if msg["type"] in ("param", "mutable") and msg["name"] in self.outside.values:
            msg["value"] = self.outside.values[msg["name"]]
        elif msg["type"] == MASK_PARENTS_TYPE and msg["name"] in self.outside.masks:
            msg["masks"].extend(self.outside.masks[msg["name"]])


def _note_outside_read(name: str) -> None:
    reads = OUTSIDE_READS.get()
    if reads is not None:
        reads.append(name)
