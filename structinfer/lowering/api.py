r"""``structinfer.attention`` and ``structinfer.explain``: the same model, lowered.

$$
y_i = \mathbb E_{p(\phi \mid x)}[\,v(\phi)\,]_i
    = \sum_j \mathrm{softmax}_j\big(\psi_{ij} + \log p(\phi_i = j)\big)\, V_j
$$

``attention(model, "out")`` returns a function with the model's signature that
computes the posterior expectation of the deterministic site ``"out"`` — the
same number `structinfer.expectation` returns — through a fused JAX
kernel when the model's structure is recognised (see
`structinfer.lowering._recognise` for the rule), and through the exact
engine otherwise (``backend="auto"``). ``explain`` reports the path taken and,
on fallback, the site and the part that was not recognised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import is_concrete
from ..exact import expectation, inspect_model, marginals
from ..handlers import OUTSIDE_READS, masking
from ._recognise import Fallback, Plan, recognise
from ._softmax import with_nan_rows
from .kernels import KERNELS, KernelConfig, auto_kernel
from .markov import markov_scan

__all__ = ["attention", "explain", "check_rows", "Explanation", "NotLowerableError",
           "MeshFallbackWarning", "BACKENDS"]

#: accepted values of ``backend``: ``"auto"``, ``"exact"`` and the kernel table's names
BACKENDS = ("auto", "exact", *KERNELS)


class NotLowerableError(ValueError):
    """A kernel backend was requested for a model that has no lowering.

    Raised by [`attention`][structinfer.lowering.attention] when ``backend`` forces a
    kernel (``"dense"``, ``"blocked"``, ``"windowed"``, ``"cudnn"``, ``"pallas"``,
    ``"mosaic"``) and the model is not recognised, or the kernel cannot run the recognised edge; the
    message names the site and the reason. A subclass of ``ValueError``.
    """


class MeshFallbackWarning(UserWarning):
    """An ``attention(..., mesh=...)`` (or ``runner=``) call runs on one device.

    Warned by the function [`attention`][structinfer.lowering.attention] returns when the
    model falls back to the exact engine, which does not use the mesh (it shards the
    lowered kernels only): once each time the call is traced (its first call, and again
    for new shapes or dtypes), naming the site and the part that was not recognised, as
    ``f.explain`` does. Silence it with ``warnings.filterwarnings("ignore",
    category=MeshFallbackWarning)`` where one device is meant.
    """


@dataclass
class Explanation:
    """Which path [`attention`][structinfer.lowering.attention] takes for a model.

    Returned by [`explain`][structinfer.lowering.explain]; ``str()`` of it reads as a
    sentence naming the kernel of every edge site, or the part that sent the model to the
    exact engine.

    Attributes:
        path: ``"lowered"`` or ``"exact"``.
        backend: the requested backend.
        kernels: edge site -> kernel (``"dense"``, ``"blocked"``, ``"windowed"``,
            ``"markov_scan"`` for a chain of Markov edges, and on a GPU ``"cudnn"``,
            ``"mosaic"`` (a Hopper GPU) or ``"pallas"``).
        follows: edge site -> the edge it follows (multi-hop), or ``None``.
        notes: edge site -> what was recognised in its prior and score, why the
            fused kernels before the one chosen were not, and what of its gradient
            another kernel computes.
        fallback: on the exact path, the site and part that was not recognised.
        sharding: edge site -> how it runs on the devices of a mesh (the mesh axis, head
            / batch sharding or ring attention, and the kernel each shard or ring step
            runs); empty on one device (``f.explain`` of an ``attention(...,
            mesh=...)`` fills it).
        mesh: on the exact path of an ``attention(..., mesh=...)`` (or ``runner=``): that
            the mesh is not used, and why; empty otherwise.
    """

    path: str
    backend: str
    kernels: dict[str, str] = field(default_factory=dict)
    follows: dict[str, str | None] = field(default_factory=dict)
    notes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fallback: Fallback | None = None
    sharding: dict[str, str] = field(default_factory=dict)
    mesh: str = ""

    def __str__(self) -> str:
        if self.path == "exact":
            why = f"falls back to the exact engine: {self.fallback}" if self.fallback else (
                "uses the exact engine (backend='exact')"
            )
            return f"structinfer.attention[{self.backend}] {why}" + (
                f"\n  {self.mesh}" if self.mesh else "")
        lines = [f"structinfer.attention[{self.backend}] is lowered:"]
        for site, k in self.kernels.items():
            hop = f" (follows '{self.follows[site]}')" if self.follows.get(site) else ""
            lines.append(f"  edge '{site}'{hop}: {k} kernel; " + "; ".join(self.notes[site]))
            if site in self.sharding:
                lines.append(f"  edge '{site}' on the mesh: {self.sharding[site]}")
        return "\n".join(lines)


#: the kernel of a chain of Markov edges (`structinfer.lowering.markov`)
MARKOV_KERNEL = "markov_scan"


def _kernels(plan: Plan, backend: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The kernel of every edge site and notes on the choice (for ``explain``): the
    ``auto`` rule's, or the forced ``backend`` when its table entry can run the edge."""
    if plan.markov is not None:
        if backend != "auto":
            raise NotLowerableError(
                f"backend '{backend}' cannot run edge site '{plan.markov.name}': it has a "
                f"Markov prior, which runs on the '{MARKOV_KERNEL}' kernel (backend='auto') "
                "or the exact engine (backend='exact')")
        return {plan.markov.name: (MARKOV_KERNEL, plan.markov.notes)}
    out = {}
    for ep in plan.edges:
        if backend == "auto":
            out[ep.name] = auto_kernel(ep.lowered)
            continue
        why = KERNELS[backend].unsupported(ep.lowered)
        if why:
            raise NotLowerableError(
                f"backend '{backend}' cannot run edge site '{ep.name}': {why}")
        out[ep.name] = (backend, ())
    return out


def _gradient_notes(name: str, lowered) -> tuple[str, ...]:
    """What of the edge's gradient another kernel than ``name`` computes (for explain)."""
    gradient = KERNELS[name].gradient if name in KERNELS else None
    said = gradient(lowered) if gradient is not None else None
    return (said,) if said else ()


def _run_edge(name: str, site: str, low, prob, batch, config: KernelConfig,
              runner: Callable | None, forced: bool):
    """Run one edge on kernel ``name`` (through ``runner`` when given), or, when the
    kernel refuses at trace time, on the first of its entry's fallbacks that can run the
    edge. Returns ``(y, L, kernel that ran, notes)`` (notes: why it is not ``name``)."""
    notes: tuple[str, ...] = ()
    while True:
        k = KERNELS[name]
        try:
            y, lse = (runner(name, low, prob, batch) if runner is not None
                      else k.run(low, prob, batch, config))
            return y, lse, name, notes
        except k.refusals as err:
            if forced:
                raise NotLowerableError(f"backend '{name}': edge site '{site}': {k.label} "
                                        f"refused: {err}") from err
            nxt = next((f for f in k.fallback if KERNELS[f].unsupported(low) is None
                        and (KERNELS[f].passed_over is None
                             or KERNELS[f].passed_over(low) is None)), None)
            if nxt is None:
                raise
            first = str(err).splitlines()[0] if str(err) else ""
            notes = (f"{k.label} refused at trace time ({type(err).__name__}: {first})",)
            name = nxt


def _execute(plan: Plan, kernels: dict, config: KernelConfig,
             runner: Callable | None = None, forced: bool = False,
             ) -> tuple[jax.Array, dict[str, jax.Array], dict[str, tuple[str, tuple[str, ...]]]]:
    """Run the plan's kernels; returns the output, each edge's row log-normaliser and the
    kernel that ran each edge with notes, where it differs from the chosen one (the
    chosen kernel refused when traced and its table entry's fallback ran).

    The output is in the value's dtype (the common dtype of the edges' value tables);
    each kernel multiplies in its operands' dtype and accumulates in float32 (float64).

    A row whose log-normaliser is not finite (no allowed parent, a NaN/inf score) is
    NaN in the output, as in the exact engine under ``jit``: never a finite number.
    """
    if plan.markov is not None:
        return (*_execute_markov(plan, config.precision), {})
    children: dict[str, list[str]] = {ep.name: [] for ep in plan.edges}
    for ep in plan.edges:
        if ep.parent is not None:
            children[ep.parent].append(ep.name)
    Y: dict[str, jax.Array] = {}
    lses: dict[str, jax.Array] = {}
    ran: dict[str, tuple[str, tuple[str, ...]]] = {}
    for ep in reversed(plan.edges):
        v = ep.table
        for c in children[ep.name]:
            v = v + Y[c]
        low = ep.lowered
        dtype = jnp.result_type(v.dtype, low.problem.v.dtype)
        prob = dataclasses.replace(low.problem, v=v.astype(dtype))
        batch = tuple(jnp.broadcast_shapes(low.batch_shape, v.shape[:-2]))
        kind = kernels[ep.name][0]
        y, lse, used, notes = _run_edge(kind, ep.name, low, prob, batch, config, runner,
                                        forced)
        if used != kind:
            ran[ep.name] = (used, notes)
        if runner is not None or not KERNELS[used].nan_rows:  # else the kernel wrote them
            # (a runner's output is sharded over the mesh: no scatter, whose indices the
            # partitioner would gather across the devices)
            y = with_nan_rows(y, lse, pass_through=KERNELS[used].rows_allowed,
                              scatter=runner is None)
        Y[ep.name] = y
        lses[ep.name] = lse
    out = None
    for ep in plan.edges:
        if ep.parent is None:
            out = Y[ep.name] if out is None else out + Y[ep.name]
    shape = plan.out_shape
    ev = len(plan.event_shape)
    lead = shape[: len(shape) - ev]
    out = jnp.broadcast_to(out, lead + out.shape[-1:]).reshape(shape)
    # in the model's order of the edge sites (the eager error names the first bad one)
    dtype = jnp.result_type(*(ep.table.dtype for ep in plan.edges))
    return out.astype(dtype), {ep.name: lses[ep.name] for ep in plan.edges}, ran


def _execute_markov(plan: Plan, precision=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Run a chain through the forward-backward kernel; no row log-normalisers (a chain
    with no allowed path is NaN, and the eager check re-runs the exact engine's checks,
    as on the exact path)."""
    mp = plan.markov
    y, _ = markov_scan(mp.initial, mp.pair, mp.table, precision=precision)
    return y.reshape(plan.out_shape).astype(mp.table.dtype), {}


def _raise_bad_rows(model: Callable, args, kwargs, lses: dict) -> None:
    """Called eagerly when a row's log-normaliser is not finite (or the exact path gave
    NaN): re-run the exact engine's checks on the concrete inputs, which raise its own
    error naming the site and the row; if they pass, name the site and row here; and for
    a model whose log-marginal is -inf (every structure has zero probability, e.g. a
    Markov chain with no allowed path) or NaN (a NaN or infinite score inside a ``scan``,
    where the engine's value checks do not see it), raise the exact engine's error of
    that, which names the model's edge sites."""
    inspect_model(model, *args, **kwargs)  # the engine's value checks, naming site and row
    for site, lse in lses.items():
        bad = np.argwhere(~np.isfinite(np.asarray(lse)))
        if bad.size:
            idx = tuple(int(i) for i in bad[0])
            raise ValueError(
                f"edge site '{site}': child {idx[-1]}"
                + (f" (batch index {idx[:-1]})" if len(idx) > 1 else "")
                + " has no parent with a finite log-potential (log-normaliser "
                f"{float(np.asarray(lse)[idx])}): every child needs an allowed parent and "
                "finite scores"
            )
    marginals(model, *args, **kwargs)  # raises for a log-marginal of -inf or NaN


def check_rows(model: Callable, log_normalisers: Mapping[str, Any], /, *args: Any,
               **kwargs: Any) -> None:
    r"""Raise the error of a row with no finite log-normaliser, as `attention` does eagerly.

    For callers that run ``f.with_log_normalisers`` of
    [`attention`][structinfer.lowering.attention] under their own transformation (e.g.
    ``jax.vmap`` over a batch, where ``f``'s own check is skipped): after the call,
    on concrete results, pick the batch element with a bad row and call this with its
    arguments and its slice of the log-normalisers (each finite exactly where
    $\log Z_i = \log \sum_j p(\phi_i = j) e^{\psi_{ij}}$ is; they may differ from it by a
    constant per child). Nothing happens when every row is finite.

    Args:
        model: the model given to `attention`.
        log_normalisers: ``{edge site: row log-normaliser}`` of one call (as
            ``f.with_log_normalisers`` returns them); empty on the exact path, where the
            exact engine's checks alone are run.
        *args: the model's positional arguments of that call (concrete arrays).
        **kwargs: the model's keyword arguments of that call.

    Raises:
        ValueError: the exact engine's error on these inputs (it names the edge site and
            the row: no allowed parent, a NaN/inf score, ...), or else the first edge
            site and row whose log-normaliser is not finite, or the exact engine's error
            of a model that gives every structure zero probability.
    """
    if log_normalisers and all(bool(np.all(np.isfinite(np.asarray(lse))))
                               for lse in log_normalisers.values()):
        return
    _raise_bad_rows(model, args, kwargs, dict(log_normalisers))


def _is_dynamic(x) -> bool:
    """Traced: arrays, floats and NumPy float scalars; static: ints (NumPy's too), bools,
    strings and the rest (sizes a model needs at trace time)."""
    if isinstance(x, (bool, np.bool_, np.integer)):
        return False
    return isinstance(x, (jax.Array, np.ndarray, np.generic, float, complex))


def _split(args, kwargs):
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    mask = tuple(_is_dynamic(x) for x in leaves)
    dyn = [x for x, d in zip(leaves, mask) if d]
    stat = tuple(x for x, d in zip(leaves, mask) if not d)
    return dyn, (treedef, mask, stat)


def _join(dyn, key):
    treedef, mask, stat = key
    it_d, it_s = iter(dyn), iter(stat)
    leaves = [next(it_d) if d else next(it_s) for d in mask]
    return jax.tree.unflatten(treedef, leaves)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_precision(precision) -> None:
    """Refuse what ``jax.lax.dot_general`` would refuse, when ``attention`` is built."""
    if precision is None:
        return
    try:
        jax.eval_shape(lambda a: jnp.matmul(a, a, precision=precision),
                       jax.ShapeDtypeStruct((2, 2), jnp.float32))
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"attention: precision {precision!r} is not a JAX matmul precision "
                         f"(None, 'default', 'high', 'highest', a jax.lax.Precision, a pair "
                         f"of them, or a jax.lax.DotAlgorithmPreset): {err}") from None


def _matmul_precision(precision):
    """``jax.default_matmul_precision`` set to ``precision`` for the exact engine's
    contractions (which take no ``precision`` argument); nothing for ``None``, JAX's
    default or a custom ``jax.lax.DotAlgorithm``."""
    if precision is None:
        return contextlib.nullcontext()
    preset = getattr(jax.lax, "DotAlgorithmPreset", None)  # JAX >= 0.4.36
    if isinstance(precision, (tuple, list)):  # a pair: the more precise of the two
        precision = max((jax.lax.Precision(p) for p in precision), key=lambda p: p.value)
    if isinstance(precision, str):
        try:
            precision = jax.lax.Precision(precision)  # "highest", "float32", ...
        except ValueError:
            if preset is None:
                return contextlib.nullcontext()
            precision = preset[precision]  # checked: a preset's name
    name = None
    if isinstance(precision, jax.lax.Precision):
        name = precision.name.lower()
    elif preset is not None and isinstance(precision, preset) and precision != preset.DEFAULT:
        name = precision.name
    return contextlib.nullcontext() if name is None else jax.default_matmul_precision(name)


def _mesh_runner(mesh, shard, axis_name, backend, runner, block_q, block_k, precision):
    """``attention``'s runner: ``runner``, or the sharded runner ``mesh``, ``shard`` and
    ``axis_name`` ask for; the arguments checked (none of the three silently ignored)."""
    if mesh is None:
        for name, given in (("shard", shard), ("axis_name", axis_name)):
            if given is not None:
                raise ValueError(f"attention: {name}={given!r} needs mesh= (the "
                                 "jax.sharding.Mesh to shard over); without it every edge "
                                 "runs on one device")
        return runner
    if backend == "exact":
        raise ValueError("attention: mesh= runs the lowered kernels on several devices, but "
                         "backend='exact' runs the exact engine on one device: pass "
                         "backend='auto' or a kernel, or no mesh")
    if runner is not None:
        raise ValueError("attention: pass mesh= or runner=, not both (mesh= builds the runner "
                         "that shards the edges)")
    from .sharded import SHARDS, ShardedRunner

    if shard is not None and shard not in SHARDS:  # ("": not a way to shard, not "heads")
        raise ValueError(f"attention: shard must be one of {SHARDS}, got {shard!r} (None, "
                         "the default: 'heads')")
    return ShardedRunner("heads" if shard is None else shard, mesh, axis_name, block_q,
                         block_k, precision)


def attention(
    model: Callable,
    value: str,
    backend: str = "auto",
    *,
    block_q: int = 256,
    block_k: int = 256,
    mesh: jax.sharding.Mesh | None = None,
    shard: str | None = None,
    axis_name: str | None = None,
    runner: Callable | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> Callable:
    r"""The posterior expectation of ``value`` as a fused, jittable function of the model's args.

    $$
    f(\text{args}) = \mathbb E_{p(\phi \mid x)}[\text{value}(\phi)], \qquad
    y_i = \sum_j \mathrm{softmax}_j\big(\psi_{ij} + \log p(\phi_i = j)\big)\, V_j
    $$

    for a value that is linear in the parent an edge picks (a gather $V_{\phi_i}$, or any
    $f(\phi_i)$ read off a table $F_j = f(\phi_i = j)$). The model's structure (edge sites,
    their priors $p(\phi_i = j)$ and scores $\psi_{ij}$) is recognised by probing it once;
    a recognised model runs through a fused kernel that gives the number
    [`structinfer.expectation`][structinfer.expectation] gives, anything else takes that
    exact engine.

    Args:
        model: a NumPyro model with [`structinfer.edge`][structinfer.edge] sites.
        value: name of a ``numpyro.deterministic`` site.
        backend: ``"auto"`` (recognise and pick a kernel, else the exact engine),
            ``"exact"`` ([`structinfer.expectation`][structinfer.expectation]), or force
            a kernel: ``"dense"``, ``"blocked"`` (online softmax over blocks,
            memory-light custom VJP), ``"windowed"`` (distance band; geometric / window
            priors), ``"cudnn"`` (cuDNN fused attention on a GPU), ``"pallas"`` (the
            Pallas flash kernel; interpreted off a GPU) or ``"mosaic"`` (forward and
            backward in Mosaic GPU, on an NVIDIA Hopper GPU) — see
            [`structinfer.lowering.accel`][structinfer.lowering.accel] and
            [`structinfer.lowering.mosaic`][structinfer.lowering.mosaic]; the kernels are
            the entries of [`KERNELS`][structinfer.lowering.KERNELS]. On a GPU,
            ``"auto"`` tries cuDNN, then Mosaic GPU (on a Hopper GPU of the running
            process), then Pallas, then the blocked kernel. A chain of
            [`Markov`][structinfer.priors.Markov] edges runs (``"auto"`` only) as a
            forward-backward scan, kernel ``"markov_scan"``
            ([`structinfer.lowering.markov`][structinfer.lowering.markov]), on one
            device (``mesh`` and ``runner`` do not apply to it). A forced kernel
            raises [`NotLowerableError`][structinfer.lowering.NotLowerableError] when the
            model has no lowering or the kernel cannot run it.
        block_q: children per block of the blocked (and windowed) kernels.
        block_k: parents per block of the blocked kernel.
        mesh: a ``jax.sharding.Mesh`` to run every lowered edge on several devices
            (``None``: one device); see ``shard``. Each shard runs the kernel the
            single-device path would (``backend``, or the ``"auto"`` rule: on a GPU the
            fused kernels). Not with ``backend="exact"`` (the exact engine runs on one
            device, as does a model ``"auto"`` sends to it: such a call warns,
            `MeshFallbackWarning`) nor with ``runner``.
        shard: with ``mesh``, ``"heads"`` (``None``: the default) splits the leading
            plate (heads / batch) over the devices, each running the chosen kernel on its
            slice; ``"sequence"`` runs ring attention over children and parents, each
            step a flash forward of one chunk pair (the Pallas kernel where cuDNN or
            Pallas was chosen, else the blocked kernel) merged by its log-normaliser
            (`structinfer.lowering.sharded`). The mesh axis must divide the leading
            plate's size (``"heads"``), or the numbers of children and parents
            (``"sequence"``): a call that breaks this raises naming the edge site.
        axis_name: the mesh axis to shard over (``None``: the mesh's only axis).
        runner: advanced — ``runner(kind, lowered, problem, batch_shape) -> (y, lse)``
            (output and row log-normaliser) replaces the kernel call; ``kind`` is the
            chosen kernel's name, a key of [`KERNELS`][structinfer.lowering.KERNELS]
            (``mesh`` builds one, from `structinfer.lowering.sharded`).
        precision: the precision of the kernels' matmuls, as JAX's matmuls take it
            (``jax.lax.dot_general``): ``None`` (JAX's default, which follows
            ``jax.default_matmul_precision`` — on a GPU, float32 matmuls may then run in
            TF32), ``"default"``, ``"high"``, ``"highest"`` (full float32), a
            ``jax.lax.Precision``, a pair of them or a ``jax.lax.DotAlgorithmPreset``.
            It reaches every matmul of the forward and backward passes; the exact engine
            runs under ``jax.default_matmul_precision`` set to it.

    Returns:
        ``f(*args, **kwargs)`` returning the expectation, shaped like the site's value
            and in its dtype (bfloat16 values give a bfloat16 answer; a float32 model
            answers in float32 with x64 enabled). Every kernel multiplies in the
            dtype of the queries, keys and values and accumulates in float32 (the
            logits, the prior's terms, the softmax and the p·v product; float64 for
            float64 inputs), as flash-attention kernels do.
            Array (and float) arguments are traced; other arguments (ints, NumPy
            integers, strings) are static. Called on concrete arrays, a child with no
            allowed parent or a NaN/inf score raises the exact engine's error (found
            from the kernel's per-row log-normaliser, no second pass), and so does a
            model that gives every structure zero probability or a score's or prior's
            argument out of its range (a negative precision, a geometric ``q`` outside
            (0, 1)); under an outer ``jit`` that row (for an argument, the answer) is
            NaN. ``f``
            is jitted internally and can be jitted, vmapped and differentiated again:
            in reverse mode on every kernel (the blocked and fused kernels' gradients
            are custom VJPs); forward mode (``jax.jvp``, ``jax.jacfwd``) on the dense
            and windowed kernels and the exact engine; second derivatives
            (``jax.hessian``) there and on the blocked kernel with a recent JAX (0.10
            has them; 0.4.33 lacks a rule its loop needs), not on the Pallas / Mosaic
            GPU kernels (a ``TypeError`` names the backends that have them) nor on
            cuDNN's (JAX's wrapper differentiates it once).
            ``f.explain(*args)`` describes the path (with ``mesh``, also how each
            edge runs on the mesh: ``Explanation.sharding``);
            ``f.with_log_normalisers(*args)`` returns ``(expectation, {edge site: row
            log-normaliser})`` without the eager check (empty on the exact path), for a
            caller that maps ``f`` itself and checks once with
            [`check_rows`][structinfer.lowering.check_rows]. A row's log-normaliser is
            $\log\sum_j e^{\ell_{ij}}$ of the kernel's logits, which are the prior's and
            the score's terms up to a constant per child (the kernels drop a prior's row
            normaliser, a Gaussian score's $-\tfrac12|x_i|^2$): finite exactly where
            $\log Z_i$ is, but not $\log Z_i$ itself (their sum is not
            `log_marginal`). On the cuDNN kernel the
            log-normaliser comes rounded to the inputs' dtype and without a gradient
            (JAX's cuDNN wrapper returns it so): a gradient through it raises; the
            other kernels differentiate it.

    Raises:
        ValueError: ``backend`` is not one of `BACKENDS`, ``shard`` is not
            ``"heads"`` / ``"sequence"``, ``shard`` or ``axis_name`` is given without
            ``mesh``, ``mesh`` is given with ``backend="exact"`` or with ``runner``,
            ``axis_name`` is not an axis of the mesh (or is ``None`` on a mesh of several
            axes), ``block_q`` / ``block_k`` is not a positive integer, or
            ``precision`` is not a matmul precision.
        TypeError: ``model`` is not callable, ``value`` is not a site name, or ``mesh``
            is not a ``jax.sharding.Mesh``.

    Warns:
        MeshFallbackWarning: with ``mesh`` (or ``runner``), when a call's model falls back
            to the exact engine, which runs on one device: once per trace of the call,
            naming the site and the reason.

    Reference:
        Singh & Buckley, "Attention as implicit structural inference" (sec. 3 and
        Table 1); the kernels follow the online softmax of Milakov & Gimelshein (2018) /
        flash attention.
    """
    _check_backend(backend)
    _check_precision(precision)
    if not callable(model):
        raise TypeError(f"attention: model must be callable, got {type(model).__name__}")
    runner = _mesh_runner(mesh, shard, axis_name, backend, runner, block_q, block_k,
                          precision)
    if not isinstance(value, str):
        raise TypeError(f"attention: value must be a site name (str), got {value!r}")
    config = KernelConfig(block_q, block_k, precision)

    def exact(args, kwargs):
        with _matmul_precision(precision):
            return expectation(model, value, *args, **kwargs), {}

    def impl(*args, **kwargs):
        if backend == "exact":
            return exact(args, kwargs)
        plan = recognise(model, value, args, kwargs)
        if not plan.ok:
            if backend == "auto":
                if runner is not None:  # once per trace: this runs when the call is traced
                    warnings.warn(f"structinfer.attention: {_unused(runner, _ON_ONE_DEVICE)}: "
                                  f"{plan.fallback}", MeshFallbackWarning, stacklevel=2)
                return exact(args, kwargs)
            raise NotLowerableError(f"backend '{backend}' cannot lower the model: {plan.fallback}")
        out, lses, _ = _execute(plan, _kernels(plan, backend), config, runner,
                                forced=backend != "auto")
        return out, lses

    cache: dict = {}

    def checked(args, kwargs, dyn, result):
        out, lses = result
        # concrete inputs and outputs: a non-finite row is an error, as in the exact engine
        # (inside our jit its value checks see tracers, and a bad value is NaN); under an
        # outer jit the row stays NaN (a param set from outside may be its only tracer)
        if all(is_concrete(x) for x in (*dyn, out, *lses.values())) and (
            any(not bool(jnp.all(jnp.isfinite(lse))) for lse in lses.values())
            or (not lses and bool(jnp.any(jnp.isnan(out))))
        ):
            _raise_bad_rows(model, args, kwargs, lses)
        return out

    reads_handlers = False  # the model reads the handlers around a call: never cached

    def with_log_normalisers(*args, **kwargs):
        nonlocal reads_handlers
        dyn, key = _split(args, kwargs)
        try:
            hash(key)
        except TypeError:
            cacheable = False
        else:
            # else run afresh under each call's handlers (a mask_parents around this call
            # would not reach a model that the cache answers for)
            cacheable = not reads_handlers and not masking()
        if not cacheable:
            call = functools.partial(impl, *args, **kwargs)
        else:
            jitted = cache.get(key)
            if jitted is None:
                def run(dyn, key=key):
                    a, kw = _join(dyn, key)
                    return impl(*a, **kw)

                jitted = cache[key] = jax.jit(run)
            call = functools.partial(jitted, dyn)
        reads: list[str] = []
        token = OUTSIDE_READS.set(reads)
        try:
            result = call()
        except TypeError as err:  # JAX's message names neither the site nor a way out
            if "forward-mode autodiff" not in str(err):
                raise
            raise TypeError(_reverse_mode_only(model, value, backend, args, kwargs)) from err
        finally:
            OUTSIDE_READS.reset(token)
        if reads:  # a param or an outside mask_parents: the cached trace
            # would keep this call's answer to them, so no call is cached from now on
            reads_handlers = True
            cache.clear()
        return result

    @functools.wraps(model)
    def fn(*args, **kwargs):
        dyn, _ = _split(args, kwargs)
        return checked(args, kwargs, dyn, with_log_normalisers(*args, **kwargs))

    fn.explain = lambda *a, **k: _explain(model, value, a, k, backend, runner)  # type: ignore[attr-defined]
    fn.with_log_normalisers = with_log_normalisers  # type: ignore[attr-defined]
    fn.__doc__ = (
        f"Posterior expectation of site '{value}' of {getattr(model, '__name__', 'model')} "
        f"(structinfer.attention, backend={backend!r}).\n\n" + (model.__doc__ or "")
    )
    return fn


def _reverse_mode_only(model, value, backend, args, kwargs) -> str:
    """Why forward-mode autodiff failed through `attention`: the edge sites whose kernel
    has a custom VJP (`Kernel.forward_mode` false), and the backends that have it."""
    try:
        kernels = explain(model, value, *args, backend=backend, **kwargs).kernels
    except Exception:  # noqa: BLE001 - the message only
        kernels = {}
    where = "; ".join(f"edge site '{site}' runs on the {KERNELS[k].label} kernel"
                      for site, k in kernels.items()
                      if k in KERNELS and not KERNELS[k].forward_mode)
    ways = ", ".join(f"'{k.name}'" for k in KERNELS.values() if k.forward_mode)
    return (f"structinfer.attention[{backend}]: {where or 'a fused kernel runs'}, whose "
            "gradient is a custom VJP, reverse mode only (jax.grad, jax.vjp, jax.jacrev); "
            f"forward mode (jax.jvp, jax.jacfwd, jax.linearize) runs on backend {ways} or "
            "'exact'")


def explain(
    model: Callable, value: str, *args: Any, backend: str = "auto", **kwargs: Any
) -> Explanation:
    r"""Say which path `attention` takes for ``model`` on these arguments, and why.

    Runs only a shape-level trace (nothing is computed). Lowering is exact for the
    patterns whose value is linear in the parent, $\mathbb E[f(\phi_i)] = \sum_j
    p(\phi_i = j \mid x)\, F_j$ ($\mathbb E[f] = P F$); anything else takes the exact
    engine. A model that *no* path can run (one the exact engine itself refuses, e.g. an
    edge site under ``numpyro.handlers.scale`` or a subsampled plate) raises the same
    error here as [`attention`][structinfer.lowering.attention] would, naming the site.

    Args:
        model: a NumPyro model with [`structinfer.edge`][structinfer.edge] sites.
        value: name of a ``numpyro.deterministic`` site.
        *args: the model's positional arguments (only their shapes and dtypes are used).
        backend: as for [`attention`][structinfer.lowering.attention]; ``"exact"``
            explains the exact path without tracing.
        **kwargs: the model's keyword arguments.

    Returns:
        The [`Explanation`][structinfer.lowering.Explanation]: on the lowered path the
            kernel of every edge site and what was recognised in its prior and score; on
            fallback the site and the part (prior, score, value, likelihood, child, ...)
            that was not recognised. ``str()`` of it reads as a sentence. (``f.explain``
            of an ``attention(..., mesh=...)`` adds how each edge runs on the mesh, and
            raises the error a call would for sizes the mesh axis does not divide.)

    Raises:
        ValueError: ``backend`` is not one of `BACKENDS`, or the exact engine refuses
            the model.
        NotLowerableError: a forced kernel cannot run a recognised edge.

    Reference:
        Singh & Buckley, "Attention as implicit structural inference", Table 1 and
        sec. 3.1 eq. 2 ($\mathbb E[f] = P F$ for a value linear in the parent).
    """
    _check_backend(backend)
    return _explain(model, value, args, kwargs, backend)


#: why a mesh is not used by a model that falls back to the exact engine
_ON_ONE_DEVICE = ("the model falls back to the exact engine, which runs on one device (a mesh "
                  "shards the lowered kernels only)")


def _unused(runner: Callable | None, why: str) -> str:
    """`Explanation.mesh` on the exact path: the mesh (or runner) given is not used."""
    if runner is None:
        return ""
    arg = "mesh=" if getattr(runner, "mesh", None) is not None else "runner="
    return f"{arg} is not used: {why}"


def _explain(model: Callable, value: str, args: tuple, kwargs: dict, backend: str,
             runner: Callable | None = None) -> Explanation:
    """`explain`, with the ``runner`` of an `attention` (a mesh's): its kernels are traced
    too, so that the errors a call would raise at trace time (a size the mesh axis does
    not divide) are raised, and each edge's ``sharding`` is its ``describe``."""
    if backend == "exact":
        return Explanation("exact", backend, mesh=_unused(
            runner, "backend='exact' runs the exact engine, on one device"))
    dyn, key = _split(args, kwargs)
    holder: dict[str, Any] = {}

    ran: dict = {}

    def f(dyn):
        a, kw = _join(dyn, key)
        plan = recognise(model, value, a, kw)
        holder["plan"] = plan
        if plan.ok:
            kernels = holder["kernels"] = _kernels(plan, backend)
            if (runner is not None and plan.markov is None) or any(
                    k in KERNELS and KERNELS[k].refusals for k, _ in kernels.values()):
                # trace the kernels too: one may refuse when traced (JAX's cuDNN wrapper),
                # and its table entry's fallback runs instead; a runner may refuse the
                # edge's sizes
                ran.update(_execute(plan, kernels, KernelConfig(), runner,
                                    forced=backend != "auto")[2])
        return 0

    jax.eval_shape(f, dyn)
    plan: Plan = holder["plan"]
    if not plan.ok:
        return Explanation("exact", backend, fallback=plan.fallback,
                           mesh=_unused(runner, _ON_ONE_DEVICE))
    kernels = {**holder["kernels"], **ran}
    if plan.markov is not None:
        one = {} if runner is None else {
            n: "runs on one device (a Markov chain's scan is not sharded)" for n in kernels}
        return Explanation("lowered", backend, kernels={n: k for n, (k, _) in kernels.items()},
                           follows={n: None for n in kernels},
                           notes={n: notes for n, (_, notes) in kernels.items()},
                           sharding=one)
    describe = getattr(runner, "describe", lambda kind, lowered: "runs through the runner")
    return Explanation(
        "lowered",
        backend,
        kernels={name: k for name, (k, _) in kernels.items()},
        follows={ep.name: ep.parent for ep in plan.edges},
        notes={ep.name: ep.lowered.terms.notes + kernels[ep.name][1]
               + _gradient_notes(kernels[ep.name][0], ep.lowered) for ep in plan.edges},
        sharding={} if runner is None else {
            ep.name: describe(kernels[ep.name][0], ep.lowered) for ep in plan.edges},
    )
