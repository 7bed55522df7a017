r"""The statement models are written with: [`edge`][structinfer.edge].

$$
\phi_i \sim p(\phi_i), \qquad \log p(x, \phi) \mathrel{+}= \psi(x_i, x_{\phi_i})
$$

An edge site is an ordinary NumPyro ``sample`` site marked for parallel
enumeration. Prior and score are folded into the site's own distribution,
$\phi_i \sim \mathrm{softmax}_j(\log p(\phi_i = j) + \psi_{ij})$, and the row
normaliser $\log \sum_j p(\phi_i = j)\, e^{\psi_{ij}}$ (which does not depend
on the edge) is a ``factor`` site ``"<name>.score"``: the joint is unchanged, and every
funsor contraction of the model (the exact engine, NumPyro's ``log_density`` under
``enum``, ``TraceEnum_ELBO``, ``MCMC(NUTS(model))``, ``infer_discrete``) sees one
normalised factor per edge, so it is float32-safe when a forbidden parent scores far
above the allowed ones. Run the model under [`structinfer.exact`][structinfer.exact] to collapse the
edges; run it plainly (``numpyro.handlers.seed``) to draw a structure from
$p(\phi) \propto p(\phi)\, e^{\psi}$ (the model's own edge distribution when
nothing else observes the edges).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.typing import ArrayLike
from numpyro.distributions.batch_util import promote_batch_shape
from numpyro.distributions.util import validate_sample
from numpyro.ops.indexing import Vindex
from numpyro.primitives import CondIndepStackFrame, apply_stack

from ._checks import (
    ROWS_CHECKED,
    as_float_array,
    check_finite,
    first_empty_row,
    float32_at_least,
    is_concrete,
    normalise_log_weights,
)
from .priors import Markov, Masked, NoParentError, StructuralPrior, as_prior
from .scores import Score, as_score

__all__ = [
    "edge",
    "EdgeInfo",
    "EdgeDistribution",
    "MaskedEdge",
    "ExpandedEdge",
    "Potential",
    "UnmaskedPotential",
    "potential",
    "gather",
    "is_enumerated",
    "is_factor",
    "active_plates",
    "parent_masks",
    "MASK_PARENTS_TYPE",
    "EDGE_SEEN_KEY",
    "ENGINE_DEPTH",
    "STEP_EDGES",
    "hidden_edge_error",
    "EDGE_INFO_KEY",
    "SCORE_SUFFIX",
    "SCAN_INDEX_KEY",
    "SCAN_RECORD_KEY",
]

EDGE_INFO_KEY = "structinfer"
"""Key of an edge site's ``infer`` dict holding its [`EdgeInfo`][structinfer.primitives.EdgeInfo]."""
SCAN_INDEX_KEY = "_scan_current_index"
"""Key NumPyro's ``scan`` sets in the ``infer`` dict of every site of a step (a site inside
a time dim)."""
SCAN_RECORD_KEY = "_control_flow_done"
"""Key NumPyro's ``scan`` sets on each site it records after the loop (stacked over the
time steps, the leading dim of its value)."""
SCORE_SUFFIX = ".score"
"""Suffix of the factor site carrying an edge's row normaliser (see [`edge`][structinfer.edge])."""


def user_site_name(name: str) -> str:
    """A site's (or its enumeration dim's) name as the model wrote it: NumPyro's ``scan``
    prefixes ``_PREV_`` to those of its unrolled first steps."""
    return re.sub("^(_PREV_)+", "", name)


@dataclass(frozen=True)
class EdgeInfo:
    """What [`edge`][structinfer.edge] records in the site's ``infer`` dict.

    Stored under the key [`EDGE_INFO_KEY`][structinfer.primitives.EDGE_INFO_KEY]. The
    lowered engine reads it to recognise dense patterns; users rarely need it.

    Attributes:
        name: the edge site's name.
        prior: its structural prior.
        score: its score, or ``None`` for no potential.
        num_children: size of the children plate ``n``.
        num_parents: size of the edge support ``m``.
        children_plate: name of the plate at ``dim=-1``.
        child: the ``child=`` index this site follows (multi-hop), ``None`` for a plain edge.
        previous: the previous edge's value that chose a [`Markov`][structinfer.priors.Markov]
            prior's row (``-1`` at the start of the chain), ``None`` for other priors.
            Valid inside the scan step that recorded it (the engine's tilt reads it there).
    """

    name: str
    prior: StructuralPrior
    score: Score | None
    num_children: int
    num_parents: int
    children_plate: str
    #: the ``child=`` index this site follows (multi-hop), ``None`` for a plain edge
    child: Any = field(default=None, compare=False, repr=False)
    #: the previous edge's value that chose a Markov prior's row (inside its scan step)
    previous: Any = field(default=None, compare=False, repr=False)

    @property
    def markov(self) -> bool:
        """Whether the edge has a [`Markov`][structinfer.priors.Markov] prior (a chain over time)."""
        return isinstance(self.prior, Markov)


def is_enumerated(site: dict) -> bool:
    """Whether a trace site (or a message in a handler) is summed out by enumeration.

    That is a latent (unobserved) ``sample`` site marked
    ``infer={"enumerate": "parallel"}``, as every [`edge`][structinfer.edge] site is. The
    one definition every module uses.

    Args:
        site: a trace site or handler message.

    Returns:
        ``True`` for an enumerated latent sample site.
    """
    return (
        site.get("type") == "sample"
        and not site.get("is_observed", False)
        and (site.get("infer") or {}).get("enumerate") == "parallel"
    )


def is_factor(site: dict) -> bool:
    """Whether a trace site (or a message) is a potential.

    An observed `sample` site whose distribution is (or wraps: expanded by a plate,
    masked) NumPyro's `Unit`, as `numpyro.factor` and the `"<edge>.score"` row
    normalisers of [`edge`][structinfer.edge] record.

    Args:
        site: a trace site or a handler message.

    Returns:
        `True` for a potential, `False` otherwise.
    """
    if site.get("type") != "sample" or not site.get("is_observed", False):
        return False
    fn = site.get("fn")
    for _ in range(32):
        if isinstance(fn, dist.distribution.Unit):
            return True
        fn = getattr(fn, "base_dist", None)
        if fn is None:
            return False
    return False  # pragma: no cover - absurdly deep wrapping


def active_plates() -> list[CondIndepStackFrame]:
    """The plates around the current statement, outermost first.

    A `deterministic` message is sent through `numpyro.primitives.apply_stack`: every
    enclosing plate (NumPyro's and funsor's enumeration plates alike) annotates it with
    its frame, as it does a `numpyro.deterministic` site. Handlers may read its name
    while it travels (`substitute` functions do), so it has one; its value is computed by
    a function that drops the name again, so no handler records it as a site (`trace`
    skips nameless messages). A `numpyro.handlers.block` entered between two plates
    hides the plates outside it, as it hides the sites inside it.

    Returns:
        NumPyro's `CondIndepStackFrame(name, dim, size)` of each plate (`size`: the
        subsample size).
    """
    msg = _probe({"type": "deterministic", "name": _PLATES_PROBE, "cond_indep_stack": []})
    return [f for f in reversed(msg["cond_indep_stack"]) if f.dim is not None]


def _probe(msg: dict) -> dict:
    """Send ``msg`` through the handlers without it being recorded as a site: its name
    travels while the handlers read it and is dropped before any records it."""
    msg.update(value=None, args=(), kwargs={})

    def drop_name():
        msg.pop("name", None)
        return ()

    msg["fn"] = drop_name
    apply_stack(msg)
    msg.pop("name", None)
    return msg


def parent_masks(name: str) -> list[jax.Array]:
    """The masks of allowed parents the handlers around an edge site add to its prior.

    A message of type `MASK_PARENTS_TYPE` is sent through the handlers (innermost
    first); each [`mask_parents`][structinfer.handlers.mask_parents] handler appends its
    mask. As [`active_plates`][structinfer.primitives.active_plates]' message, it is
    never recorded as a site.

    Args:
        name: the edge site's name (handlers may read it).

    Returns:
        The masks, innermost handler first (empty when there is none).
    """
    return list(_probe({"type": MASK_PARENTS_TYPE, "name": name, "masks": []})["masks"])


def _table_of_masked_out_rows(prior: StructuralPrior, num_children: int,
                              child: Any) -> jax.Array | None:
    """The prior's table when the only children it leaves no parent are masked out by
    ``numpyro.handlers.mask`` (padding: they are not there), else ``None`` (its error
    stands). Read on the error path of the prior's own check only; with a traced mask
    (or prior) the table, unchecked: a kept child left no parent is NaN."""
    mask = numpyro.get_mask() if child is None else None
    if mask is None or mask is True:
        return None
    token = ROWS_CHECKED.set(False)
    try:
        with jax.ensure_compile_time_eval():  # a concrete prior stays concrete under jit
            table = prior.log_table(num_children)
    finally:
        ROWS_CHECKED.reset(token)
    if not (is_concrete(table) and is_concrete(mask)):  # which rows are kept is not
        return table  # known here: a kept child left no parent reads NaN, as under jit
    try:
        allowed = np.isfinite(np.asarray(table)) | ~np.asarray(mask, bool)[..., None]
    except ValueError:  # a mask that does not broadcast: NumPyro's error comes later
        return None
    return table if first_empty_row(allowed) is None else None


def _kept_rows(shape: tuple[int, ...]) -> np.ndarray | None:
    """Which rows of a ``(..., rows, parents)`` table of ``shape`` the enclosing
    ``numpyro.handlers.mask`` keeps: a bool array broadcasting against it, ``None`` to
    check every row (no mask, or one that does not broadcast: NumPyro's own error comes
    later), all ``False`` for a traced mask (which rows are kept is not known here; a bad
    kept row is NaN, as under ``jit``)."""
    try:
        mask = numpyro.get_mask()
    except KeyError:  # NumPyro 0.15's scan step: its block reads a name get_mask's lacks
        return None
    if mask is None:
        return None
    if not is_concrete(mask):
        mask = False
    kept = np.asarray(mask, bool)[..., None]
    try:
        np.broadcast_shapes(kept.shape, shape)
    except ValueError:
        return None
    return kept


def _check_score(score: jax.Array, logits: jax.Array, name: str, rows_masked: bool) -> None:
    """Refuse, on concrete values, a NaN or +inf score entry (-inf forbids an edge, as a
    masked prior does) and a child whose score's ``-inf`` entries forbid every parent its
    prior allows (the rule of an empty prior row; NaN under a trace). With
    ``rows_masked`` (the mask's batch is the table's rows: no ``child=``), a child that
    ``numpyro.handlers.mask`` masks out (padding) may have no parent: it is not there.

    One host copy of the edge's table ``logits`` (log-prior + score) gives both: a NaN or
    +inf score entry is NaN or +inf there too (``-inf + inf`` is NaN), so the score itself
    is read only on that error path, for the entry's index in its own shape."""
    what = f"edge site '{name}': score"
    if not is_concrete(logits):  # a traced prior: the score's own values, where concrete
        check_finite(score, what, allow_neg_inf=True)
        return
    table = np.asarray(logits)
    bad = table.size and not table.max() < np.inf  # the max is NaN or +inf: a bad entry
    allowed = np.isfinite(table)
    where = first_empty_row(allowed)
    # the mask is asked only when it matters (old NumPyro's get_mask fails under some
    # handlers)
    kept = _kept_rows(table.shape) if rows_masked and (bad or where) else None
    if bad:
        # a masked-out child's score is not read (padding may hold anything); the
        # score's own values, for the entry's kind (+inf beside a -inf prior is NaN in
        # the table) and index
        check_finite(score if kept is None else np.where(kept, np.asarray(score), 0.0),
                     what, allow_neg_inf=True)
    if where is not None and kept is not None:  # a masked-out child may have none
        where = first_empty_row(allowed | ~kept)
    if where is not None:
        raise NoParentError(
            f"edge site '{name}': the score allows no parent for {where}: its -inf entries "
            "forbid every parent the prior allows, and every child needs at least one "
            "parent with non-zero probability (under jit the answer is NaN)"
        )


def _sample_edge(name: str, fn: dist.Distribution, infer: dict) -> jax.Array:
    """``numpyro.sample`` of an edge site; refused when the exact engine is running but a
    ``numpyro.handlers.block`` hid the site from it (its handlers never set the site's
    `EDGE_SEEN_KEY`). Inside a scan step, which NumPyro runs hidden from the engine and
    replays to it afterwards, the engine's handlers check the replay instead
    (`STEP_EDGES`)."""
    seen = {"seen": False, "name": name}
    infer[EDGE_SEEN_KEY] = seen

    def hidden() -> bool:
        # a scan's steps are hidden while they run and replayed to the engine afterwards
        return bool(ENGINE_DEPTH.get()) and not seen["seen"] and SCAN_INDEX_KEY not in infer

    try:
        phi = numpyro.sample(name, fn, infer=infer)
    except AssertionError as e:  # older NumPyro: a hidden site is drawn with no PRNG key
        if hidden():
            phi = None
        elif _drawn_without_key(e):
            raise _no_key_error(name) from e
        else:
            raise
    if hidden():
        raise hidden_edge_error(name, in_cond=_in_cond_branch())
    if ENGINE_DEPTH.get() and not seen["seen"]:  # a scan step: its replay must reach them
        for pending in STEP_EDGES.get():
            pending.add(name)
    return phi


def _drawn_without_key(e: AssertionError) -> bool:
    """Whether ``e`` is a NumPyro distribution's ``assert is_prng_key(key)`` in ``sample``
    (the innermost frame of its traceback)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    code = tb.tb_frame.f_code
    return code.co_name == "sample" and "numpyro" in code.co_filename


def _no_key_error(name: str) -> ValueError:
    """The error for an edge site drawn with no PRNG key and not enumerated."""
    return ValueError(
        f"edge site '{name}' was drawn at random with no PRNG key: the model ran with no "
        "seed handler and without the exact engine enumerating the edge (as NumPyro's "
        "numpyro.infer.util.log_likelihood and log_density run it), so the edge is "
        "neither summed out nor drawn. For the log-likelihood with the edges summed out "
        "use si.exact.pointwise_log_likelihood; for log p(x) use si.log_marginal; to draw "
        "the edges from their prior wrap the model in numpyro.handlers.seed"
    )


def _in_cond_branch() -> bool:
    """Whether this runs inside a branch of NumPyro's ``cond`` (its ``cond_wrapper``, which
    traces the branches hidden from the handlers, is on the call stack); ``False`` where
    that function is not found."""
    try:
        from numpyro.contrib.control_flow.cond import cond_wrapper
    except ImportError:  # pragma: no cover - another NumPyro layout
        return False
    code = getattr(cond_wrapper, "__code__", None)
    return any(f.frame.f_code is code for f in inspect.stack(0))


def hidden_edge_error(name: str, in_cond: bool = False) -> ValueError:
    """The error for an edge site the exact engine's handlers cannot see.

    Args:
        name: the edge site's name.
        in_cond: the site is inside a branch of ``numpyro.contrib.control_flow.cond``
            (hidden by NumPyro itself) rather than behind a ``numpyro.handlers.block``.

    Returns:
        The ``ValueError`` to raise, naming the site, the cause and what to do.
    """
    if in_cond:
        return ValueError(
            f"edge site '{name}' is inside a branch of numpyro.contrib.control_flow.cond, "
            "which NumPyro runs hidden from the handlers and cannot enumerate, so the "
            "exact engine cannot sum the edge out. Choose with data instead: one edge "
            "whose score (or prior) the condition picks, e.g. "
            "si.scores.Custom(jnp.where(pred, score_if_true, score_if_false))"
        )
    return ValueError(
        f"edge site '{name}' is hidden from the engine by a block handler "
        "(numpyro.handlers.block, in any form: hide, hide_fn, expose or none; also one "
        "around a numpyro scan, which hides the edges of its steps), so the exact engine "
        "cannot see it to sum it out (NumPyro would sample it at random). Leave edge sites "
        "unblocked in the model the engine reads (an SVI guide may block them), or fix "
        "the edge at a value with numpyro.handlers.condition"
    )


EDGE_SEEN_KEY = "structinfer_edge_seen"
"""Key of an [`edge`][structinfer.edge] site's ``infer`` dict: a ``{"seen": False}``
holder that the exact engine's handlers set to ``True`` when the site reaches them."""

ENGINE_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar(
    "structinfer_engine_depth", default=0)
"""How many of the exact engine's handlers that must see every edge are active (entered
and not exited); while one is, an edge that none of them saw is refused."""

STEP_EDGES: contextvars.ContextVar[tuple[set[str], ...]] = contextvars.ContextVar(
    "structinfer_step_edges", default=())
"""One set per active engine handler of `ENGINE_DEPTH`: the names of the edges sampled in a
scan step while it was active (NumPyro hides a step's sites and replays them after the
loop). The handler refuses, when it exits, an edge of its set whose replay did not reach
it (a ``numpyro.handlers.block`` around the scan)."""

MASK_PARENTS_TYPE = "structinfer_mask_parents"
"""Type of the message [`parent_masks`][structinfer.primitives.parent_masks] sends."""

_PLATES_PROBE = "structinfer.active_plates"
"""Name of the message [`active_plates`][structinfer.primitives.active_plates] sends
(never recorded as a site)."""


def gather(table: jax.Array, index: jax.Array) -> jax.Array:
    r"""``table[..., index]`` along the last (parent) axis, enumeration-safe, O(output) memory.

    ``table`` has shape ``batch + (parents,)``; ``index`` any shape that broadcasts
    against ``batch`` when right-aligned (as an enumerated edge value does).
    Plain chained indexing silently misaligns enumerated dims (numpyro issue 2252);
    this is [`Vindex`][numpyro.ops.indexing.Vindex] semantics:

    $$
    \text{out}[\ldots] = \text{table}[\ldots, \text{index}[\ldots]]
    $$

    When the index varies only along dims where ``batch`` has size one (an enumerated
    edge value, shape ``(m, 1, ..., 1)``), the result is a column ``take`` followed by a
    transpose: no ``index``-shaped broadcast of the table is ever built, so reading an
    ``(n, m)`` table at the enumerated value costs ``O(n m)``, not ``O(n m^2)``. When the
    index is exactly ``0..m-1`` along one dim (what enumeration produces; checked with one
    comparison, at run time with ``lax.cond`` when the index is traced), it is a
    transpose of the table, no gather.
    Out-of-range indices, negative ones included (no NumPy wrap: a parent index is never
    negative, and ``-1`` is the "no path" that `map_edges` and `sample_edges` return under
    ``jit``), read NaN, never a clamped or wrapped row (in a floating table; a signed
    integer table reads its dtype's most negative value, an unsigned one its largest, a
    boolean one ``True``, on every path; the exact engine refuses such a read at an edge
    value).

    It is how a value $v_i(x, \phi_i = j) = V x_j$ is read (Singh & Buckley
    sec. 3.2, the value function), and how an edge site's log-prob is evaluated.

    Args:
        table: ``batch + (parents,)`` values, e.g. a value per parent.
        index: integer parent indices; broadcasts against ``batch`` when right-aligned.

    Returns:
        ``table[..., index]``, of the broadcast shape of ``batch`` and ``index``.
    """
    tshape, ishape = tuple(jnp.shape(table)[:-1]), tuple(jnp.shape(index))
    r = max(len(tshape), len(ishape))
    tpad = (1,) * (r - len(tshape)) + tshape
    ipad = (1,) * (r - len(ishape)) + ishape
    m = table.shape[-1]
    if not all(a == 1 or b == 1 for a, b in zip(tpad, ipad)):
        out = Vindex(table)[..., index]  # JAX clamps out-of-range reads: mark them
        return jnp.where((index >= 0) & (index < m), out, _fill_value(out.dtype))
    out_shape = tuple(max(a, b) for a, b in zip(tpad, ipad))
    flat = jnp.reshape(index, (-1,))
    moved, take = _gather_branches(tpad, ipad, out_shape, m)
    if flat.shape[0] != m or sum(s != 1 for s in ipad) != 1:
        return take(table, flat)
    is_range = jnp.all(flat == jnp.arange(m, dtype=flat.dtype))
    if is_concrete(is_range):  # an index with values (run eagerly): choose here
        return moved(table, flat) if bool(is_range) else take(table, flat)
    return jax.lax.cond(is_range, moved, take, table, flat)


def _fill_value(dtype):
    """What `gather` reads out of range, as ``jnp.take(mode="fill")`` fills: NaN in a
    floating table, the most negative value of a signed integer one, the largest of an
    unsigned one, ``True`` in a boolean one."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.array(jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return jnp.array(jnp.iinfo(dtype).min, dtype)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return jnp.array(jnp.iinfo(dtype).max, dtype)
    return jnp.array(True, dtype)


@functools.lru_cache(maxsize=512)
def _gather_branches(tpad: tuple, ipad: tuple, out_shape: tuple, m: int):
    """`gather`'s two ways, built once per shape and jitted: the same function objects on
    every call let JAX reuse ``lax.cond``'s traced branches and, run eagerly, one compiled
    program each (closures made per call were traced and compiled again at every call;
    unjitted, each of their operations was a program of its own)."""
    r = len(tpad)
    perm = [k for pair in zip(range(r), range(r, 2 * r)) for k in pair]

    def take(table, flat):
        # out[b, v] = table[b, index[v]] with b and v on disjoint dims: take the columns,
        # then interleave the table's dims with the index's (one of each pair has size 1)
        # NaN past the end (floats), and for a negative index (no NumPy wrap: a parent
        # index is never negative; -1 is the "no path" of map_edges under jit)
        flat = jnp.where(flat < 0, m, flat)
        cols = jnp.take(table, flat, axis=-1, mode="fill")
        return jnp.reshape(jnp.transpose(jnp.reshape(cols, tpad + ipad), perm), out_shape)

    p = next((k for k, s in enumerate(ipad) if s != 1), 0)

    def moved(table, flat):
        # the index is 0..m-1 along its one dim (an enumerated edge value): the result
        # is the table with its last axis moved there — a transpose, not a gather
        x = jnp.squeeze(jnp.reshape(table, tpad + (m,)), axis=p)
        return jnp.moveaxis(x, -1, p)

    return jax.jit(moved), jax.jit(take)


class _EdgeWrappers:
    r"""``mask`` and ``expand`` of an edge and of its wrappers: a mask makes a
    [`MaskedEdge`][structinfer.primitives.MaskedEdge], an expansion (a plate the table
    lacks a dim of) an [`ExpandedEdge`][structinfer.primitives.ExpandedEdge], however
    they nest (NumPyro's own would make plain wrappers, whose mask adds $\log m$ per
    masked-out child to log Z)."""

    def mask(self, mask: bool | ArrayLike) -> dist.Distribution:
        """This edge with its masked-out children taking their parent uniformly among
        those the edge allows.

        ``numpyro.handlers.mask`` calls it; see [`MaskedEdge`][structinfer.primitives.MaskedEdge].

        Args:
            mask: boolean, broadcasting against the batch shape (``True`` keeps a child).

        Returns:
            The masked edge (this one for a Python ``True``, as NumPyro's).
        """
        return self if mask is True else MaskedEdge(self, mask)

    def expand(self, batch_shape: tuple[int, ...]) -> dist.Distribution:
        """This edge broadcast to ``batch_shape``.

        Args:
            batch_shape: the new batch shape.

        Returns:
            An [`ExpandedEdge`][structinfer.primitives.ExpandedEdge] (this one when the shape
                is its own).
        """
        batch_shape = tuple(batch_shape)
        return self if batch_shape == self.batch_shape else ExpandedEdge(self, batch_shape)


class EdgeDistribution(_EdgeWrappers, dist.CategoricalLogits):
    r"""NumPyro's ``Categorical`` over parents, with a log-prob that is ``O(output)`` in memory.

    $$
    \log p(\phi_i = j) = \ell_{ij} - \log \textstyle\sum_{j'} e^{\ell_{ij'}}
    $$

    NumPyro's ``CategoricalLogits.log_prob`` broadcasts the ``(..., children,
    parents)`` table against the value before gathering: at the enumerated value
    ``(parents, 1, ..., 1)`` that is a ``parents x children x parents`` array (4.7 GB
    at 1024 children). Here the log-prob is [`gather`][structinfer.gather] of the normalised table:
    ``O(children x parents)``. Everything else (sampling, support, enumeration,
    pytree) is NumPyro's.

    Args:
        logits: log-weights ``(..., children, parents)``, normalised on construction;
            ``-inf`` marks a forbidden parent.
        log_normalizer: ``logsumexp(logits, -1)`` when the caller has it already.
        validate_args: NumPyro's argument validation, off by default (it rejects the
            ``-inf`` of forbidden parents); values outside the support read NaN.

    Attributes:
        log_normalizer: the row log-normaliser $\log \sum_{j} e^{\ell_{ij}}$ of the
            ``logits`` given (set on construction; copies NumPyro makes of the
            distribution as a pytree do not carry it).

    The edge site of Singh & Buckley sec. 3.1 (eq. 1), enumerated by NumPyro's funsor
    backend.
    """

    def __init__(self, logits: jax.Array, *, log_normalizer: jax.Array | None = None,
                 validate_args: bool = False):
        logits, self.log_normalizer = normalise_log_weights(logits, log_normalizer)
        super().__init__(logits, validate_args=validate_args)

    @validate_sample
    def log_prob(self, value: jax.Array) -> jax.Array:
        r"""$\log p(\phi_i = \text{value})$, read with [`gather`][structinfer.gather].

        Args:
            value: parent indices; an enumerated value ``(parents, 1, ..., 1)`` included.

        Returns:
            The log-probabilities (NaN outside the support, a negative value included).
        """
        lp = gather(self.logits, value)  # NumPy semantics: -1 would read the last parent
        return jnp.where(jnp.asarray(value) < 0, jnp.nan, lp)


class ExpandedEdge(_EdgeWrappers, dist.ExpandedDistribution):
    """NumPyro's ``ExpandedDistribution`` of an edge, masked as the edge is.

    A plate whose dim the edge's table lacks (a prior shared by the batch) expands the
    edge; ``numpyro.handlers.mask`` written around that plate then masks the expanded
    distribution. As the edge's, its ``mask`` makes a
    [`MaskedEdge`][structinfer.primitives.MaskedEdge].

    Args:
        base_dist: the edge's distribution.
        batch_shape: the expanded batch shape.
    """

    def __init__(self, base_dist: dist.Distribution, batch_shape: tuple[int, ...] = ()):
        super().__init__(base_dist, batch_shape)


class MaskedEdge(_EdgeWrappers, dist.MaskedDistribution):
    r"""An edge under ``numpyro.handlers.mask``: a masked-out child is not there.

    $$
    \log p(\phi_i = j) = \begin{cases} \log p_{\text{edge}}(\phi_i = j) & \text{kept} \\
    -\log |A_i| \ (j \in A_i), \ -\infty \ (j \notin A_i) & \text{masked out} \end{cases}
    $$

    with $A_i$ the parents child $i$'s edge allows: those its prior (after any
    [`mask_parents`][structinfer.handlers.mask_parents] mask) gives non-zero
    probability, less those a ``-inf`` score entry forbids (or a NaN or ``+inf`` one,
    which is not refused in a masked-out row); every parent ($|A_i| = m$)
    when it allows none (a padded child whose parents are all padding too).

    NumPyro's mask gives a masked-out site log-density 0 at every value; summed over the
    ``m`` parents by enumeration that is a factor ``m``, so each masked-out child (a
    padded position, a step past a sequence's end) would add $\log m$ to log Z, and
    would take parents its mask or prior forbids. Here its edge is uniform over $A_i$
    instead, a proper distribution: it adds nothing to log Z, its marginal is uniform on
    $A_i$ (never a forbidden parent) and, with nothing observed through it, its
    expectation is the mean over $A_i$. Its row normaliser (the ``"<edge>.score"``
    factor) is masked by NumPyro as usual, to 0. Draws are the edge's own, as NumPyro's
    mask changes densities only (``Predictive`` masks every site to skip their
    log-densities). Conditioned on a value (``numpyro.handlers.condition``), a
    masked-out child contributes $-\log |A_i|$: at a parent it allows and at a value that
    is no parent (a padding sentinel such as $-1$); $-\infty$ at a parent it forbids.
    Nested masks intersect. Made by the edge's ``mask``.

    Args:
        base_dist: the edge's distribution.
        mask: boolean, broadcasting against the batch shape (``True`` keeps a child).
    """

    def __init__(self, base_dist: dist.Distribution, mask: bool | ArrayLike):
        super().__init__(base_dist, mask)

    def log_prob(self, value: jax.Array, intermediates: Any = None) -> jax.Array:
        r"""The kept children's edge log-probabilities; for the others $-\log |A_i|$ on
        the parents $A_i$ their edge allows ($-\log m$ on every parent when it allows
        none), $-\infty$ on the other parents, and $-\log |A_i|$ at a value that is no
        parent (outside $0 \ldots m-1$: a padding sentinel such as $-1$, ignored as
        NumPyro's mask ignores a masked-out value)."""
        fn = self.base_dist
        while not isinstance(fn, EdgeDistribution):  # expanded, or masked again
            fn = fn.base_dist
        table, row = _uniform_on_allowed(fn.logits)
        value = jnp.asarray(value)
        outside = (value < 0) | (value >= jnp.shape(table)[-1])
        uniform = jnp.where(outside, row[..., 0], gather(table, value))
        if self._mask is False:  # every child masked out
            shape = jax.lax.broadcast_shapes(tuple(self.base_dist.batch_shape),
                                             jnp.shape(uniform))
            return jnp.broadcast_to(uniform, shape)
        lp = super().log_prob(value)
        return lp if self._mask is True else jnp.where(self._mask, lp, uniform)


def _uniform_on_allowed(logits: jax.Array) -> jax.Array:
    r"""The log-table of a masked-out child's edge: uniform over the parents its row of
    ``logits`` allows (finite: the prior's and ``mask_parents``' support, less the
    score's ``-inf`` entries, and its NaN and ``+inf`` ones, which a masked-out child does
    not have refused), over every parent for a row that allows none (a padded
    child); constant in the logits (no gradient flows through it). Returns the table and
    its rows' constant $-\log |A_i|$ (``batch + (1,)``)."""
    allowed = jnp.isfinite(jax.lax.stop_gradient(logits))
    count = jnp.sum(allowed, axis=-1, keepdims=True)
    m = jnp.shape(logits)[-1]
    dtype = logits.dtype
    row = jnp.where(count > 0, -jnp.log(jnp.maximum(count, 1).astype(dtype)),
                    -jnp.log(jnp.asarray(m, dtype)))
    return jnp.where((count == 0) | allowed, row, -jnp.inf), row


class Potential(dist.Unit):
    r"""NumPyro's ``Unit`` (a ``numpyro.factor``) that also works inside ``scan``.

    $$\log p(\text{value}) = \log\psi \quad \text{(any value; an unnormalised factor)}$$

    NumPyro's ``Unit`` keeps its batch shape when ``numpyro.contrib.control_flow.scan``
    stacks the sites of its steps, so a ``numpyro.factor`` inside a scan body loses its
    time dim under enumeration. This subclass declares how its batch shape grows
    (``promote_batch_shape``), so a potential inside a scan body is one factor per
    step. Write it with [`potential`][structinfer.primitives.potential].

    Args:
        log_factor: the log-potential $\log\psi$, any batch shape.
        validate_args: NumPyro's argument validation.
    """

    def __init__(self, log_factor: ArrayLike, *, validate_args: bool = False):
        super().__init__(log_factor, validate_args=validate_args)

    def mask(self, mask: bool | ArrayLike) -> dist.Distribution:
        """NumPyro's mask, in the factor's dtype for a Python ``False`` too (NumPyro's
        zeros would be in the default float: float64 under x64)."""
        return super().mask(jnp.asarray(False) if mask is False else mask)


class UnmaskedPotential(Potential):
    r"""A [`Potential`][structinfer.primitives.Potential] that a mask leaves as it is.

    $$\log p(\text{value}) = \log\psi \quad \text{under any mask}$$

    ``numpyro.handlers.mask`` keeps it: it is an engine's device (a tilt, reading a value
    recorded under the user's mask), not a term of the model.

    Args:
        log_factor: the log-potential $\log\psi$, any batch shape.
        validate_args: NumPyro's argument validation.
    """

    def mask(self, mask: bool | ArrayLike) -> UnmaskedPotential:
        """This potential, unmasked."""
        return self


@promote_batch_shape.register
def _promote_potential(d: Potential) -> Potential:
    new = dist.Unit.__new__(type(d))
    new.__dict__.update(d.__dict__)
    new._batch_shape = tuple(jnp.shape(d.log_factor))
    return new


def potential(name: str, log_factor: ArrayLike, *, maskable: bool = True) -> None:
    r"""``numpyro.factor(name, log_factor)`` that also works inside a ``scan`` body.

    Adds $\log\psi$ = ``log_factor`` to the model's log-density as an observed
    [`Potential`][structinfer.primitives.Potential] site (a ``Unit``, so it is a factor
    for [`is_factor`][structinfer.primitives.is_factor] and for NumPyro).

    Args:
        name: the site name.
        log_factor: the log-potential, any batch shape.
        maskable: ``False`` for a factor ``numpyro.handlers.mask`` must not drop (an
            [`UnmaskedPotential`][structinfer.primitives.UnmaskedPotential]: the
            engine's tilts, which read a value recorded under the user's mask).
    """
    log_factor = jnp.asarray(log_factor)
    fn = Potential(log_factor) if maskable else UnmaskedPotential(log_factor)
    numpyro.sample(name, fn, obs=jnp.zeros(jnp.shape(log_factor) + (0,)))


def _children_plate(name: str) -> tuple[CondIndepStackFrame, list[CondIndepStackFrame]]:
    plates = active_plates()
    if not plates:
        raise ValueError(
            f"structinfer.edge('{name}') must be called inside a numpyro.plate over its "
            "children, e.g. `with numpyro.plate('queries', n): si.edge(...)`"
        )
    for p in plates:
        if p.dim == -1:
            return p, plates
    dims = {p.name: p.dim for p in plates}
    raise ValueError(
        f"edge site '{name}': no plate at dim=-1 (plates: {dims}); the children plate "
        "must be the rightmost batch dim — pass dim=-1 to it, or enter it first"
    )


def _batch_shape(plates: list[CondIndepStackFrame]) -> tuple[int, ...]:
    nd = max(-p.dim for p in plates)
    shape = [1] * nd
    for p in plates:
        shape[p.dim] = p.size
    return tuple(shape)


def _check_table(table: jax.Array, what: str, site: str, batch, num_parents: int) -> None:
    shape = tuple(table.shape)
    if shape[-1] != num_parents:
        raise ValueError(
            f"edge site '{site}': {what} has {shape[-1]} parents (shape {shape}) but the "
            f"prior has {num_parents}"
        )
    lead = len(shape) - 1 - len(batch)
    if lead > 0 and any(s != 1 for s in shape[:lead]):
        raise ValueError(
            f"edge site '{site}': {what} of shape {shape} has more batch dims than the "
            f"plates around the edge (batch shape {tuple(batch)}); add a plate for each "
            "leading dim (e.g. heads). (Under enumeration the extra dims may instead be "
            "another enumerated site's: a prior or score that depends on a discrete "
            "latent, such as a mixture over temperatures, is not supported; sum that "
            "site out by hand, or make it continuous.)"
        )
    table_batch = shape[max(lead, 0) : -1]
    try:
        fits = jnp.broadcast_shapes(table_batch, tuple(batch)) == tuple(batch)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"edge site '{site}': {what} of shape {shape} does not fit the plates' batch "
            f"shape {tuple(batch)} + ({num_parents},): the layout is (..., children, parents) "
            "with children on the plate at dim=-1"
        )


def edge(
    name: str,
    prior: StructuralPrior | dist.CategoricalLogits | dist.CategoricalProbs,
    score: Score | ArrayLike | None = None,
    *,
    child: ArrayLike | None = None,
    previous: ArrayLike | None = None,
    infer: dict | None = None,
) -> jax.Array:
    r"""Declare an edge site: child $i$ takes one parent $\phi_i$ under ``prior``.

    $$
    p(x, \phi) \propto \prod_i p(\phi_i)\, \exp \psi(x_i, x_{\phi_i})
    $$

    Must be called inside one or more ``numpyro.plate``; the plate at ``dim=-1``
    indexes the children. Extra plates (heads, batch) broadcast.

    Args:
        name: site name (must be unique in the model).
        prior: a [`structinfer.priors`][structinfer.priors] prior (or a NumPyro ``Categorical``).
        score: a [`structinfer.scores`][structinfer.scores] score, or a ``(..., children, parents)``
            array of log-potentials; ``None`` for no potential (e.g. when the
            parent enters through an observed sample site instead). A ``-inf`` entry
            forbids its edge, as a masked prior does.
        child: follow a chain (multi-hop attention): the node whose edge this is, e.g.
            the value of a previous edge site. The site is then node ``child``'s edge
            with its posterior conditional
            $p(\phi_{\text{child}} = k \mid x) = \mathrm{softmax}_k(\log p(\phi_{\text{child}} = k) + \psi_{\text{child},k})$
            as distribution (Singh & Buckley appendix 7.3: the second hop uses the
            edge of the node the first hop reached). No separate score factor is
            added: each hop is normalised, so ``log Z`` is that of the first hop.
            Its values must index this edge's children (a value past them is an error
            on concrete values; under ``jit`` its row reads NaN, never a clamped row).
        previous: with a [`Markov`][structinfer.priors.Markov] prior (and only then):
            the previous edge's value, which chooses the prior's row; ``-1`` for the
            first edge of the chain (a state ``>= K`` is an error on concrete values;
            under ``jit`` its row reads NaN, never a clamped row). The edge must then be
            inside a ``numpyro.contrib.control_flow.scan`` over time with ``history=1``
            (the time steps are its children; no children plate is needed), and its row
            normaliser, which
            depends on the previous edge, is the ``"<name>.score"``
            [`potential`][structinfer.primitives.potential]. ``previous`` has the
            batch shape of the plates inside the step, the step's score that batch shape
            (or one that broadcasts to it) then the $K$ states, and the step returns the
            edge as the scan's carry.
        infer: extra ``infer`` entries for the sample site.

    Returns:
        The edge variable (parent index): shape = the plates' batch shape when the
            model is run plainly, an enumeration tensor under the exact engine.

    Raises:
        ValueError: if the edge is not inside a plate at ``dim=-1``, or the prior or score
            does not fit the plates' ``(..., children)`` batch shape and the prior's
            parents, or the score has a NaN or ``+inf`` entry, or (on concrete values; NaN
            under ``jit``) its ``-inf`` entries leave a child no parent, or (likewise) a
            ``child=`` value is not one of the edge's children; for a Markov edge, if the
            step's score or ``previous`` does not have the plates' batch shape (a scan
            step returning a carry other than the edge raises under the exact engine).
        TypeError: if ``name``, ``prior`` or ``score`` has the wrong type.

    Examples:
        ```python
        import jax.numpy as jnp
        import numpyro
        import structinfer as si

        def model(q, k):
            with numpyro.plate("queries", q.shape[0]):
                si.edge("phi", si.priors.Uniform(k.shape[0]), si.scores.Dot(q, k))

        q, k = jnp.ones((3, 2)), jnp.ones((5, 2))
        attention = si.marginals(model, q, k)["phi"]  # p(phi_i = j | q, k)
        assert attention.shape == (3, 5)  # one row over the 5 keys per query
        ```
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"edge: name must be a non-empty str, got {name!r}")
    if isinstance(prior, Markov) or previous is not None:
        return _markov_edge(name, prior, score, previous, child, infer)
    child_plate, plates = _children_plate(name)
    batch = _batch_shape(plates)
    num_children = batch[-1]
    prior = as_prior(prior, name)
    for mask in parent_masks(name):
        try:
            prior = Masked(prior, mask)
        except (TypeError, ValueError) as e:
            raise type(e)(f"edge site '{name}': mask_parents: {e}") from None
    num_parents = prior.num_parents
    try:
        log_prior = prior.log_table(num_children)
    except NoParentError as e:
        log_prior = _table_of_masked_out_rows(prior, num_children, child)
        if log_prior is None:
            raise NoParentError(f"edge site '{name}': {e}") from None
    except ValueError as e:
        raise ValueError(f"edge site '{name}': {e}") from None
    except TypeError as e:  # e.g. JAX's broadcasting of parameters of mismatched shapes
        if type(e) is not TypeError:  # JAX's own subclasses (a concretization error) as is
            raise
        raise TypeError(f"edge site '{name}': prior {type(prior).__name__}: {e}") from e
    _check_table(log_prior, "prior table", name, batch, num_parents)

    score_obj = None
    score_table = None
    if score is not None:
        score_obj = as_score(score, name)
        try:
            score_table = score_obj.dense()
        except (TypeError, ValueError) as e:  # parameters whose shapes do not broadcast
            if type(e) not in (TypeError, ValueError):  # JAX's own subclasses as they are
                raise
            raise type(e)(f"edge site '{name}': score {type(score_obj).__name__}: {e}") from e
        _check_table(score_table, "score", name, batch, num_parents)
        if prior.parameter_dtype is None:  # uniform, a mask, Python numbers: no dtype of
            # its own, the score's (in float32 for a 16-bit score, as the engine sums it)
            log_prior = log_prior.astype(float32_at_least(score_table).dtype)
        elif jnp.result_type(log_prior, score_table) != log_prior.dtype:
            # a wider score (a float32 parameter in a float64 model): normalise the
            # prior in the score's dtype, not in the parameter's before promoting
            log_prior = prior.log_table(num_children, score_table.dtype)

    info = EdgeInfo(name, prior, score_obj, num_children, num_parents, child_plate.name, child)
    site_infer = {"enumerate": "parallel", EDGE_INFO_KEY: info}
    if infer:
        site_infer.update(infer)
    # 16-bit tables are summed and contracted in float32, as the kernels accumulate
    logits = float32_at_least(log_prior)
    if score_table is not None:
        logits = logits + float32_at_least(score_table)
        # NaN / +inf entries, children left none
        _check_score(score_table, logits, name, rows_masked=child is None)
    if child is not None:
        # node `child`'s edge, with its exact posterior conditional as distribution:
        # row `child` of the (..., children, parents) table, where the children dim
        # is replaced by the index (a singleton dim keeps the plates' batch dims —
        # heads, batch — aligned with the index's own right-aligned dims)
        logits = jnp.broadcast_to(logits, logits.shape[:-2] + (num_children, num_parents))
        rows_fn = EdgeDistribution(logits, validate_args=False)
        # a node left no parent (a traced prior or score; concrete ones raised above) has
        # no conditional: NaN, not a row of -inf that would drop the paths through it
        table = jnp.where(jnp.isfinite(rows_fn.log_normalizer)[..., None], rows_fn.logits,
                          jnp.nan)
        child = jnp.asarray(child)
        inside = (child >= 0) & (child < num_children)
        if is_concrete(inside) and not bool(jnp.all(inside)):
            bad = int(child[~inside].reshape(-1)[0])
            raise ValueError(
                f"edge site '{name}': child= takes the value {bad}, but the edge has "
                f"{num_children} children (plate '{child_plate.name}'): a hop follows the "
                "node the previous hop reached, so the previous edge's parents must be "
                "this edge's children"
            )
        # JAX would clamp the row read past the end: NaN there (under jit) instead
        rows = Vindex(jnp.expand_dims(table, -3))[..., child, :]
        rows = jnp.where(inside[..., None], rows, jnp.nan)
        return _sample_edge(name, EdgeDistribution(rows, validate_args=False), site_infer)
    fn = EdgeDistribution(logits, validate_args=False)
    phi = _sample_edge(name, fn, site_infer)
    if score_table is not None:
        # log p(phi_i = j) + psi_ij = log softmax_j(log p + psi) + log sum_j' p e^psi:
        # the edge's own factor is normalised and the row normaliser does not depend
        # on the edge, so no contraction mixes two factors over one edge
        potential(name + SCORE_SUFFIX, fn.log_normalizer)
    return phi


def _markov_edge(name, prior, score, previous, child, infer) -> jax.Array:
    """[`edge`][structinfer.edge] with a Markov prior: one step of a chain inside a scan."""
    if not isinstance(prior, Markov):
        raise TypeError(
            f"edge site '{name}': previous= chooses the row of a structinfer.priors.Markov "
            f"prior, but the prior is {type(prior).__name__}"
        )
    if child is not None:
        raise ValueError(f"edge site '{name}': a Markov edge cannot also follow child=")
    if parent_masks(name):
        raise ValueError(f"edge site '{name}': mask_parents does not apply to a Markov edge "
                         "(its parents are the chain's states); call the chain outside it")
    if previous is None:
        raise ValueError(
            f"edge site '{name}': a Markov prior chooses its row by the previous edge: pass "
            "previous= (the scan carry holding the previous edge's value, -1 at the start "
            "of the chain)"
        )
    previous = jnp.asarray(previous)
    if not jnp.issubdtype(previous.dtype, jnp.integer):
        raise TypeError(
            f"edge site '{name}': previous must be an integer edge value (-1 at the start "
            f"of the chain), got dtype {previous.dtype}"
        )
    k = prior.num_parents
    # on the host: a concrete start closed over by a jitted model stays concrete, but a
    # jnp comparison of it would be traced
    held = np.asarray(previous) if is_concrete(previous) else None
    if prior.log_initial is None and held is not None and bool(np.any(held < 0)):
        raise ValueError(
            f"edge site '{name}': the chain's first edge (previous=-1) has no initial "
            "distribution: give the Markov prior log_initial=, or start the chain from a "
            "given previous edge"
        )
    if held is not None and bool(np.any(held >= k)):
        raise ValueError(
            f"edge site '{name}': previous= holds {int(np.max(held))}, but the Markov "
            f"prior's states are 0 ... {k - 1} (-1 starts the chain)"
        )
    plates = active_plates()
    batch = _batch_shape(plates) if plates else ()
    if not _fits_plates(previous.shape, batch):
        raise _previous_shape_error(name, previous.shape, batch)
    logits = float32_at_least(prior.row(previous))  # 16 bits: summed in float32
    score_obj = None
    if score is not None:
        if isinstance(score, Score):
            score_obj, table = score, score.dense()
        else:  # one step's log-potentials, (..., K); integers read as floats
            table = as_float_array(score, f"edge site '{name}': score")
        if table.ndim < 1 or table.shape[-1] != k:
            raise ValueError(
                f"edge site '{name}': score has shape {tuple(jnp.shape(table))}, expected "
                f"(..., {k}) (one log-potential per parent of this step)"
            )
        if not _fits_plates(table.shape[:-1], batch):
            raise _step_score_error(name, table.shape, batch, "its dims under the plates "
                                    "do not match the plates' sizes")
        # -inf forbids the state at this step, as a -inf score forbids an edge; a step
        # numpyro.handlers.mask masks out is not read (padding may hold anything)
        bad = is_concrete(table) and not np.asarray(table).max(initial=-np.inf) < np.inf
        kept = _kept_rows(table.shape) if bad else None  # (asked only then: old NumPyro's
        # get_mask fails under some handlers)
        check_finite(table if kept is None else np.where(kept, np.asarray(table), 0.0),
                     f"edge site '{name}': score", allow_neg_inf=True)
        logits = logits + float32_at_least(table)
    plate = next((p for p in plates if p.dim == -1), None)
    info = EdgeInfo(name, prior, score_obj, batch[-1] if batch else 1, k,
                    plate.name if plate is not None else "", previous=previous)
    site_infer = {"enumerate": "parallel", EDGE_INFO_KEY: info}
    if infer:
        site_infer.update(infer)
    fn = EdgeDistribution(logits)
    phi = _sample_edge(name, fn, site_infer)
    if SCAN_INDEX_KEY not in site_infer:
        raise ValueError(
            f"edge site '{name}': a Markov prior couples consecutive edges over time, so "
            "the edge must be inside a numpyro.contrib.control_flow.scan over the time "
            "steps (the carry holds the previous edge); it was called outside a time dim"
        )
    if jnp.shape(phi) == jnp.broadcast_shapes(logits.shape[:-1], batch):
        # nothing enumerated the edge (a plain run: the model alone, or the engine's first
        # pass), so no dim is an enumeration dim: the edge, which the step returns as the
        # scan's carry, has the plates' batch shape, as its previous value had (under
        # enumeration both gain enumeration dims on the left, which NumPyro's scan allows)
        if score is not None and table.ndim - 1 > len(batch):
            raise _step_score_error(
                name, table.shape, batch,
                f"its leading dims {tuple(table.shape[: table.ndim - 1 - len(batch)])} lie "
                "outside every plate, so the edge, the scan's carry, would change shape "
                "from step to step: drop them, or add a plate for each")
        if tuple(previous.shape) != batch:
            raise _previous_shape_error(name, previous.shape, batch)
    if score is not None:
        potential(name + SCORE_SUFFIX, fn.log_normalizer)
    return phi.astype(previous.dtype)  # the scan's carry keeps its type (int32 / int64)


def _fits_plates(shape: tuple[int, ...], batch: tuple[int, ...]) -> bool:
    """Whether the dims of ``shape`` under the plates (right-aligned with their batch
    shape ``batch``) broadcast to the plates' sizes; dims left of the plates are not
    looked at."""
    n = min(len(shape), len(batch))
    return all(s in (1, b) for s, b in zip(shape[len(shape) - n:], batch[len(batch) - n:]))


def _step_score_error(name: str, shape: tuple[int, ...], batch: tuple[int, ...],
                      why: str) -> ValueError:
    """The error for a Markov step's score that does not fit the plates around the edge."""
    return ValueError(
        f"edge site '{name}': the step's score has shape {tuple(shape)}, expected "
        f"{tuple(batch) + (shape[-1],)} (the batch shape {tuple(batch)} of the plates "
        f"around the edge, then one log-potential per state; a dim of size 1 "
        f"broadcasts): {why}"
    )


def _previous_shape_error(name: str, shape: tuple[int, ...],
                          batch: tuple[int, ...]) -> ValueError:
    """The error for a Markov edge's ``previous=`` that does not have the edge's shape."""
    return ValueError(
        f"edge site '{name}': previous= has shape {tuple(shape)}, expected {tuple(batch)} "
        "(the batch shape of the plates around the edge): the scan's carry holds the "
        "previous edge, so it has the edge's shape from the start; begin it at "
        f"jnp.full({tuple(batch)}, -1)"
    )
