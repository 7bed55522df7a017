r"""Evaluate a function with its constant-index gathers turned into layout ops.

The recogniser reads a value table by running the model on a probe
($\phi = 0, \dots, m-1$). The probe is a constant, so in a model such as
``Vindex(v)[..., phi, :]`` every index of the resulting ``gather`` is known at
trace time — yet XLA keeps it as an element-wise gather (one index tuple per
output element) followed by a transpose: an $O(n d)$ pass over the value
matrix that the kernel called directly does not pay. Next to the cheap windowed
kernel that pass was 20% of the run time.

`eval_with_views` traces ``fn`` to a jaxpr and replays it. A ``gather``
whose indices do not depend on ``fn``'s inputs is evaluated once, at trace time,
on the integer source map $s = 0, \dots, |x| - 1$ (shaped like its operand
``x``); that gives, for every output element, the flat position it reads. When
that map is affine in the output coordinates,

$$
M[o] = b + \sum_a t_a\, o_a,
$$

with every non-zero step $t_a$ equal to the row-major stride of a distinct
operand axis and the whole box in bounds, the gather *is* a view of ``x``:
``slice`` → ``reshape`` → ``transpose`` → ``broadcast_in_dim``, all of which XLA
fuses or folds away. The check compares the reconstructed map with the gather's
own on every element, so the rewrite is exact or not taken; any other gather (and
every other equation) is replayed unchanged.

`replay_with_views` does the same for a program already staged (the lowering's
[`ProbeProgram`][structinfer.exact.ProbeProgram], staged once with the probes as its
inputs): the probe inputs are declared known, so the gathers they drive fold exactly
as those of a constant probe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as prims

from .._jaxpr import Call, classify, is_literal, open_jaxpr

__all__ = ["eval_with_views", "gather_as_view", "replay_with_views"]

_MAX_ELEMENTS = 1 << 26  # larger operands / index maps are left to XLA's gather


def _bind(eqn, ins):
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX: (sub-functions bound first, params)
        subfuns, params = params
        return eqn.primitive.bind(*subfuns, *ins, **params)
    return eqn.primitive.bind(*ins, **params)


def _is_array_leaf(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))  # tracers are jax.Arrays


def gather_as_view(x, indices, params):
    """``lax.gather(x, indices, **params)`` as slice/reshape/transpose/broadcast, or None.

    ``indices`` must be concrete. Returns None when the gather is not a strided view
    of ``x`` (see the module docstring for the test).
    """
    S = tuple(int(s) for s in x.shape)
    size = int(np.prod(S)) if S else 1
    if size == 0 or size > _MAX_ELEMENTS:
        return None
    src = np.arange(1, size + 1, dtype=np.int32).reshape(S)
    p = dict(params)
    if "fill_value" in p:
        p["fill_value"] = 0  # out-of-bounds reads (FILL_OR_DROP) show up as 0 below
    with jax.ensure_compile_time_eval():
        M = np.asarray(prims.gather_p.bind(jnp.asarray(src), jnp.asarray(indices), **p))
    if M.size == 0 or M.size > _MAX_ELEMENTS or M.min() < 1:
        return None
    M = M.astype(np.int64) - 1
    out_shape = M.shape
    base = int(M.reshape(-1)[0])
    steps = []
    for a, extent in enumerate(out_shape):
        if extent == 1:
            steps.append(0)
            continue
        unit = [0] * len(out_shape)
        unit[a] = 1
        steps.append(int(M[tuple(unit)]) - base)
    recon = np.full(out_shape, base, dtype=np.int64)
    for a, t in enumerate(steps):
        if t:
            shape = [1] * len(out_shape)
            shape[a] = out_shape[a]
            recon = recon + t * np.arange(out_shape[a], dtype=np.int64).reshape(shape)
    if not np.array_equal(recon, M):
        return None
    strides = [int(np.prod(S[b + 1:])) for b in range(len(S))]
    start = [int(c) for c in np.unravel_index(base, S)] if S else []
    axis_of = {}  # operand axis -> output axis
    for a, t in enumerate(steps):
        if t == 0:
            continue
        cands = [b for b in range(len(S)) if S[b] > 1 and strides[b] == t]
        if len(cands) != 1 or cands[0] in axis_of or start[cands[0]] + out_shape[a] > S[cands[0]]:
            return None
        axis_of[cands[0]] = a
    limit = [s + 1 for s in start]
    for b, a in axis_of.items():
        limit[b] = start[b] + out_shape[a]
    y = lax.slice(x, start, limit) if S else x
    kept = sorted(axis_of)
    y = y.reshape(tuple(limit[b] - start[b] for b in kept))
    out_axes = [axis_of[b] for b in kept]
    order = sorted(range(len(kept)), key=lambda i: out_axes[i])
    if order != list(range(len(kept))):
        y = jnp.transpose(y, order)
    return lax.broadcast_in_dim(y, out_shape, tuple(sorted(out_axes)))


def eval_with_views(fn, *args):
    """``fn(*args)``, replayed from its jaxpr with view-like constant gathers rewritten.

    ``args`` may be any pytrees; their array leaves become the jaxpr's inputs and
    everything else is closed over. Numerically identical to ``fn(*args)`` (the
    rewrite only reorders reads of the same elements).
    """
    leaves, tree = jax.tree.flatten(args)
    dyn = [i for i, leaf in enumerate(leaves) if _is_array_leaf(leaf)]

    def flat_fn(*dyn_leaves):
        full = list(leaves)
        for i, leaf in zip(dyn, dyn_leaves):
            full[i] = leaf
        return fn(*jax.tree.unflatten(tree, full))

    dyn_vals = [leaves[i] for i in dyn]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
    res = replay_with_views(closed, dyn_vals)
    if res is None:  # pragma: no cover - make_jaxpr always gives its constants' values
        return fn(*args)
    return jax.tree.unflatten(jax.tree.structure(out_shape), res)


def replay_with_views(closed, vals, known=(), outputs=None):
    """Evaluate a closed jaxpr on ``vals``, its view-like constant gathers rewritten.

    Args:
        closed: a closed jaxpr (``jax.make_jaxpr``'s result).
        vals: one value per input.
        known: the positions of the inputs whose values are constants (NumPy arrays):
            what they drive is computed at trace time, as if they were closed over.
        outputs: the positions of the outputs wanted (all when ``None``); only the
            equations they need are evaluated.

    Returns:
        The wanted outputs, in order (numerically those of evaluating ``closed``); or
        ``None`` when the jaxpr cannot be opened.
    """
    top = open_jaxpr(closed)
    if top is None:  # pragma: no cover - make_jaxpr always gives its constants' values
        return None
    jaxpr = top.jaxpr
    outvars = list(jaxpr.outvars)
    if outputs is not None:
        outvars = [outvars[i] for i in outputs]
    known = set(known)
    thunks = [(lambda v=v: v) if i in known else None for i, v in enumerate(vals)]
    return _replay(jaxpr, top.consts, list(vals), thunks, outvars)[0]


def _needed(jaxpr, outvars) -> set:
    """The equations of ``jaxpr`` (by position) that ``outvars`` or an effect need."""
    need = {v for v in outvars if not is_literal(v)}
    keep = set()
    for k in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[k]
        if eqn.effects or any(o in need for o in eqn.outvars):
            keep.add(k)
            need.update(v for v in eqn.invars if not is_literal(v))
    return keep


def _fold(eqn, thunks):
    """Thunks for ``eqn``'s outputs, computed at trace time on first use (memoised)."""
    cache = []

    def value(k):
        if not cache:
            with jax.ensure_compile_time_eval():
                out = _bind(eqn, [t() for t in thunks])
            cache.append(out if eqn.primitive.multiple_results else [out])
        return cache[0][k]

    return [lambda k=k: value(k) for k in range(len(eqn.outvars))]


def _replay(jaxpr, consts, vals, thunks, outvars=None):
    """Evaluate ``jaxpr``; ``thunks[i]`` (or None) yields input ``i`` as a concrete value.

    Returns the outputs (``outvars``, by default all) and, for each, a thunk when it does
    not depend on traced inputs; only the equations they need are evaluated.
    Plain calls (nested ``jit``) are replayed inline so the gathers inside them are seen;
    every other equation (loops, ``custom_jvp`` functions, bodies the jaxpr walker does
    not know) is bound as it is.
    """
    env, thunk = {}, {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
        if not isinstance(c, jax.core.Tracer):
            thunk[v] = lambda c=c: c
    for v, a, t in zip(jaxpr.invars, vals, thunks):
        env[v] = a
        if t is not None:
            thunk[v] = t

    def read(x):
        return x.val if is_literal(x) else env[x]

    def known(x):
        if is_literal(x):
            return lambda: x.val
        return thunk.get(x)

    outvars = list(jaxpr.outvars) if outvars is None else outvars
    keep = _needed(jaxpr, outvars)
    for k, eqn in enumerate(jaxpr.eqns):
        if k not in keep:
            continue
        ins = [read(x) for x in eqn.invars]
        tins = [known(x) for x in eqn.invars]
        call = classify(eqn)
        outs, touts = None, None
        if isinstance(call, Call) and call.kind == "call" and not eqn.effects:
            outs, touts = _replay(call.body.jaxpr, call.body.consts, ins, tins)
        elif (eqn.primitive is prims.gather_p and tins[0] is None and tins[1] is not None
              and eqn.invars[1].aval.size <= _MAX_ELEMENTS
              and eqn.invars[0].aval.size <= _MAX_ELEMENTS):
            try:
                out = gather_as_view(ins[0], np.asarray(tins[1]()), eqn.params)
            except Exception:  # pragma: no cover - any surprise: keep the plain gather
                out = None
            if out is not None:
                outs = [out.astype(eqn.outvars[0].aval.dtype)]
        if outs is None:
            out = _bind(eqn, ins)
            outs = out if eqn.primitive.multiple_results else [out]
        if touts is None:
            if not eqn.effects and all(t is not None for t in tins):
                touts = _fold(eqn, tins)
            else:
                touts = [None] * len(outs)
        for o, val, t in zip(eqn.outvars, outs, touts):
            env[o] = val
            if t is not None:
                thunk[o] = t
    return [read(x) for x in outvars], [known(x) for x in outvars]
