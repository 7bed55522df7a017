r"""The kernel table: every kernel a lowered edge site can run on, one entry each.

A recognised edge site (its logits $\ell_{ij} = \psi_{ij} + \log\tilde p(\phi_i = j)$
and value table $V$) is run by one kernel, which returns

$$
y_i = \sum_j \frac{e^{\ell_{ij}}}{\sum_{j'} e^{\ell_{ij'}}}\, V_j, \qquad
L_i = \log\sum_j e^{\ell_{ij}}.
$$

[`KERNELS`][structinfer.lowering.KERNELS] maps each kernel's name to a
[`Kernel`][structinfer.lowering.Kernel] entry that says what it cannot run
(``unsupported``), runs it (``run``), and what `structinfer.attention` needs to know
around it (whether it writes the NaN rows itself, what to run when it refuses when
traced, which kernel ring attention's steps use in its place). Everything that picks or
runs a kernel reads this one table: `structinfer.attention` (a forced ``backend`` is
checked against the entry's ``unsupported``; ``"auto"`` asks `auto_kernel`),
`structinfer.explain` (which names the entry and why the ones before it were not taken)
and the multi-device runners of `structinfer.lowering.sharded` (each shard runs the entry
the single-device path would). Adding a kernel is adding one entry.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax

from . import accel
from ._lower import Lowered
from ._spec import Problem
from .blocked import band_blocks, blocked_attention, mask_per_block
from .dense import dense_attention
from .mosaic import (
    mosaic_backward,
    mosaic_backward_refusals,
    mosaic_forward,
    mosaic_unsupported,
)
from .windowed import windowed_kernel

__all__ = ["Kernel", "KernelConfig", "KernelTable", "KERNELS", "DENSE_MAX", "auto_kernel"]

#: ``"auto"`` uses the dense kernel up to this many logits per batch element
DENSE_MAX = 128 * 128


@dataclass(frozen=True)
class KernelConfig:
    """What `structinfer.attention` passes every kernel besides the edge.

    Attributes:
        block_q: children per block (blocked and windowed kernels; the Pallas kernel
            picks its own tiles).
        block_k: parents per block (blocked kernel).
        precision: the matmuls' ``precision`` (``None``: JAX's default).
    """

    block_q: int = 256
    block_k: int = 256
    precision: jax.lax.PrecisionLike = None

    def __post_init__(self):
        for name, what in (("block_q", "children"), ("block_k", "parents")):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
                raise ValueError(f"{name} must be a positive integer ({what} per block), "
                                 f"got {x!r}")


@dataclass(frozen=True)
class Kernel:
    """One entry of the kernel table [`KERNELS`][structinfer.lowering.KERNELS].

    Attributes:
        name: the kernel's name (a ``backend`` of `structinfer.attention`, and what
            `structinfer.explain` reports).
        unsupported: ``unsupported(lowered) -> str | None``: why the kernel cannot run
            this lowered edge site (its structure, dtypes, shapes or the platform), or
            ``None`` when it can. A forced ``backend`` whose entry gives a reason raises
            `NotLowerableError` with it.
        run: ``run(lowered, problem, batch_shape, config) -> (y, L)``: the output
            ``batch + (n, dv)`` in the value's dtype and the row log-normaliser
            ``batch + (n,)`` in the accumulation dtype. ``problem`` and ``batch_shape``
            are the arrays to run on (the lowered site's, with the value table of an
            edge that others follow added in; a shard's on a mesh); ``lowered`` gives the
            static terms and the trace-time mask; ``config`` a `KernelConfig`.
        nan_rows: whether ``run`` itself writes NaN in the rows whose log-normaliser is
            not finite (no allowed parent, a NaN / inf score): otherwise
            `structinfer.attention` writes them (the exact engine's answer under ``jit``).
        rows_allowed: whether every child of an edge the kernel can run has an allowed
            parent (its ``unsupported`` refuses every mask that could leave one
            without): a row's log-normaliser is then not finite only for non-finite
            inputs, and the NaN rows `structinfer.attention` writes add no pass over
            the output where it is not differentiated (a scatter into it, which XLA may
            run in place; not yet timed on a GPU), and are differentiated as the
            identity (`with_nan_rows`).
        title: how explanations name it ("cuDNN"); the name when empty.
        refusals: exception types ``run`` may raise when traced, meaning the kernel
            cannot run here after all (JAX's cuDNN wrapper checks the installed cuDNN and
            GPU only then); ``()``: it never refuses.
        fallback: the kernels to try, in order, when ``run`` refused: the first whose
            ``unsupported`` and ``passed_over`` are ``None`` runs (`structinfer.explain`
            says why).
        passed_over: optional ``passed_over(lowered) -> str | None``: why ``"auto"``
            does not take the kernel although it can run the edge (another measured
            faster there, or the device it is for is not this process's); a forced
            ``backend`` still runs it.
        passes: for a kernel built on the blocked kernel's custom VJP, its replacement
            ``(forward, backward)`` passes (``(None, None)``: the blocked kernel's own);
            such a kernel takes traced global start offsets. ``None`` otherwise.
        gradient: optional ``gradient(lowered) -> str | None``: what of the edge's
            gradient another kernel computes (a pass this kernel's backward hands on),
            for `structinfer.explain`; ``None`` when its own passes compute all of it.
        ring_step: the kernel each step of ring attention (``shard="sequence"``) runs
            in this one's place: one with ``passes`` (it takes the chunk's global
            offsets and returns ``L``, by which the steps are merged).
        forward_mode: whether its output differentiates in forward mode (``jax.jvp``,
            ``jax.jacfwd``): plain JAX operations, no custom VJP.
    """

    name: str
    unsupported: Callable[[Lowered], str | None]
    run: Callable[[Lowered, Problem, tuple[int, ...], KernelConfig],
                  tuple[jax.Array, jax.Array]]
    nan_rows: bool = False
    rows_allowed: bool = False
    title: str = ""
    refusals: tuple[type[BaseException], ...] = ()
    fallback: tuple[str, ...] = ()
    passed_over: Callable[[Lowered], str | None] | None = None
    passes: tuple[Callable | None, Callable | None] | None = None
    gradient: Callable[[Lowered], str | None] | None = None
    ring_step: str = "blocked"
    forward_mode: bool = False

    @property
    def label(self) -> str:
        """How explanations and errors name the kernel: ``title``, else ``name``."""
        return self.title or self.name


def _can_run(lowered: Lowered) -> None:
    return None


def _run_blocked_family(kernel: Kernel, lowered: Lowered, prob: Problem, batch,
                        config: KernelConfig):
    forward, backward = kernel.passes
    terms = lowered.terms
    bq, bk = band_blocks(terms, config.block_q, config.block_k)
    if forward is None and backward is None:  # the blocked kernel's own passes
        terms, prob = mask_per_block(terms, prob, batch, lowered.mask)
    return blocked_attention(terms, prob, batch, block_q=bq, block_k=bk,
                             mask=lowered.mask, forward=forward, backward=backward,
                             nan_rows=True, precision=config.precision)


def _run_blocked(lowered, prob, batch, config):
    return _run_blocked_family(KERNELS["blocked"], lowered, prob, batch, config)


def _run_pallas(lowered, prob, batch, config):
    return _run_blocked_family(KERNELS["pallas"], lowered, prob, batch, config)


def _run_dense(lowered, prob, batch, config):
    return dense_attention(lowered.terms, prob, batch, config.precision)


def _windowed_unsupported(lowered: Lowered) -> str | None:
    t = lowered.terms
    if t.dmin is None or t.dmax is None:
        return ("it has no finite distance band (use a Geometric prior with max_distance "
                "or a Restricted.window prior)")
    return None


def _run_windowed(lowered, prob, batch, config):
    return windowed_kernel(lowered.terms, prob, batch, block_q=config.block_q,
                           precision=config.precision)


def _cudnn_unsupported(lowered: Lowered) -> str | None:
    why = accel.cudnn_unsupported(lowered.terms, lowered.problem, lowered.batch_shape)
    if why is None and accel.platform() != "gpu":
        why = f"cuDNN runs on a GPU (the platform is {accel.platform()})"
    return why or accel.cudnn_wrapper_missing()


def _run_cudnn(lowered, prob, batch, config):
    return accel.cudnn_attention(lowered.terms, prob, batch,
                                 unscaled=lowered.unscaled_dot(prob))


def _pallas_unsupported(lowered: Lowered) -> str | None:
    return accel.pallas_unsupported(lowered.terms, lowered.problem, lowered.batch_shape)


def _mosaic_unsupported(lowered: Lowered) -> str | None:
    why = mosaic_unsupported(lowered.terms, lowered.problem, lowered.batch_shape,
                             lowered.mask)
    if why is None and accel.platform() != "gpu":
        why = f"Mosaic GPU runs on an NVIDIA GPU (the platform is {accel.platform()})"
    if why is None and jax.default_backend() == "gpu":  # the real device (tests fake platform)
        cc = str(getattr(jax.devices()[0], "compute_capability", ""))
        if not cc.startswith("9"):
            why = (f"the Mosaic GPU kernel's warpgroup matmuls need an NVIDIA Hopper GPU "
                   f"(compute capability 9.x; this one: {cc or 'unknown'})")
    return why


def _run_mosaic(lowered, prob, batch, config):
    return _run_blocked_family(KERNELS["mosaic"], lowered, prob, batch, config)


def _mosaic_device_unseen(lowered: Lowered) -> str | None:
    """Why ``"auto"`` passes the Mosaic GPU kernel over: it takes it only on the Hopper
    GPU this process runs on (lowering for CUDA from another host takes the Triton
    kernel, which lowers without the CUDA plugin's Mosaic GPU compiler)."""
    if jax.default_backend() != "gpu":
        return (f"auto takes it only on a Hopper GPU of this process (JAX's default "
                f"backend is {jax.default_backend()})")
    return None


def _mosaic_gradient(lowered: Lowered) -> str | None:
    """Which of the edge's gradient `mosaic_backward` hands to the Triton kernel's passes
    (a pass the Mosaic GPU kernel refuses, a relative-position table's gradient that its
    dK/dV pass cannot sum)."""
    refused = mosaic_backward_refusals(lowered.terms, lowered.problem, lowered.batch_shape,
                                       lowered.mask)
    labels = {"dQ": "the dQ pass", "dK/dV": "the dK/dV pass",
              "table": "the relative-position table's gradient, when the table is trained"}
    parts = [f"{labels[name]} ({why})" for name, why in refused.items()]
    if not parts:
        return None
    return "the Pallas (Triton) kernel computes, of its gradient: " + "; ".join(parts)


def _cudnn_passed_over(lowered: Lowered) -> str | None:
    """Why ``"auto"`` passes cuDNN over for one of our kernels: the geometric prior
    (measured, `accel.pallas_measured_faster`), and a relative-position table where the
    Mosaic GPU kernel runs on this process's Hopper GPU (inferred, below).

    The second rule, from an NVIDIA H100 (JAX 0.11.2, bfloat16, head dim 128): at n =
    4096 with 32 heads the Mosaic GPU kernel ran relpos in 0.70-0.72 ms forward and 2.41
    ms forward + backward, `jax.nn`'s cuDNN with the bias table materialised in 0.94-1.00
    and 4.75-5.28 ms (a table over `accel.CUDNN_BIAS_MAX`, so not one this path hands to
    cuDNN). At n = 1024 and 2048 with 16 heads, where the table fits, the Pallas kernel
    was faster forward (0.063 / 0.191 ms against 0.097 / 0.262) and as fast or 20% slower
    forward + backward (0.271 / 0.948 against 0.268 / 0.793), and the Mosaic GPU kernel
    measured 1.3-1.9x (forward) and 1.2-2.4x (backward) faster than the Pallas one where
    both were timed (n = 4096 and 16384). Mosaic GPU against cuDNN at the sizes this
    rule decides is inferred from those, not measured side by side, and a trained
    table's gradient was not compared."""
    why = accel.pallas_measured_faster(lowered.terms)
    if why is None and lowered.terms.relpos is not None and _mosaic_runs_here(lowered):
        why = ("the Mosaic GPU kernel is preferred for a relative-position table (faster "
               "than cuDNN with the table materialised where measured, n = 4096)")
    return why


def _mosaic_runs_here(lowered: Lowered) -> bool:
    """Whether ``"auto"`` would take the Mosaic GPU kernel for this edge: it can run it
    and a Hopper GPU is this process's device."""
    return _mosaic_unsupported(lowered) is None and _mosaic_device_unseen(lowered) is None


_ENTRIES = (
    Kernel("dense", _can_run, _run_dense, forward_mode=True),
    Kernel("blocked", _can_run, _run_blocked, nan_rows=True, passes=(None, None)),
    Kernel("windowed", _windowed_unsupported, _run_windowed, forward_mode=True),
    Kernel("cudnn", _cudnn_unsupported, _run_cudnn, title="cuDNN", rows_allowed=True,
           refusals=(NotImplementedError, ValueError, RuntimeError, TypeError),
           fallback=("mosaic", "pallas", "blocked"), passed_over=_cudnn_passed_over,
           ring_step="pallas"),
    Kernel("pallas", _pallas_unsupported, _run_pallas, nan_rows=True, title="Pallas",
           passes=(accel.pallas_forward, accel.pallas_backward), ring_step="pallas"),
    Kernel("mosaic", _mosaic_unsupported, _run_mosaic, nan_rows=True, title="Mosaic GPU",
           passes=(mosaic_forward, mosaic_backward), ring_step="pallas",
           passed_over=_mosaic_device_unseen, gradient=_mosaic_gradient),
)

class KernelTable(Mapping[str, Kernel]):
    """The kernel table: name -> [`Kernel`][structinfer.lowering.Kernel] (read-only).

    ``"dense"``, ``"blocked"``, ``"windowed"``, ``"cudnn"``, ``"pallas"``, ``"mosaic"``, in
    the order of `BACKENDS` (which are ``"auto"``, ``"exact"`` and these).
    `structinfer.attention` checks a forced ``backend`` against its entry, runs every
    edge through the entry
    chosen (on one device or on each shard of a mesh) and writes the NaN rows where the
    entry does not; `structinfer.explain` names the entry that runs each edge. A mapping
    without item assignment: the table is read, never edited.
    """

    def __init__(self, entries: tuple[Kernel, ...]):
        self._entries = {k.name: k for k in entries}

    def __getitem__(self, name: str) -> Kernel:
        return self._entries[name]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"KernelTable({', '.join(self._entries)})"


KERNELS: KernelTable = KernelTable(_ENTRIES)
"""The kernel table: name -> [`Kernel`][structinfer.lowering.Kernel], a read-only
[`KernelTable`][structinfer.lowering.KernelTable] (``"dense"``, ``"blocked"``,
``"windowed"``, ``"cudnn"``, ``"pallas"``, ``"mosaic"``)."""


def auto_kernel(lowered: Lowered) -> tuple[str, tuple[str, ...]]:
    """The kernel ``backend="auto"`` runs a lowered edge site on, and notes on the choice.

    The rule: with more than `DENSE_MAX` logits per batch element, on a GPU, the first
    of the platform's fused kernels (`structinfer.lowering.accel.GPU_KERNELS`: cuDNN,
    then Mosaic GPU on a Hopper GPU, then Pallas) that can run the edge and is not
    passed over (for a faster one, or a Mosaic GPU kernel with no Hopper GPU in the
    process); else the windowed kernel for a geometric prior whose distance band is at
    most half the parents; else the blocked kernel (large) or the dense one (small). The
    notes say why each fused kernel before the one taken was not.

    Returns:
        ``(name, notes)``: a key of `KERNELS` and a tuple of sentences.
    """
    t = lowered.terms
    large = t.num_children * t.num_parents > DENSE_MAX
    notes: tuple[str, ...] = ()
    if large and accel.platform() == "gpu":
        for name in accel.GPU_KERNELS:
            k = KERNELS[name]
            why = k.unsupported(lowered)
            if why is None and k.passed_over is not None:
                why = k.passed_over(lowered)
            if why is None:
                return name, notes
            notes += (f"not {k.label}: {why}",)
    band = t.dmin is not None and t.dmax is not None
    if t.geometric and band and 2 * (t.dmax - t.dmin + 1) <= t.num_parents:
        return "windowed", notes
    return ("blocked" if large else "dense"), notes
