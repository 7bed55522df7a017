"""Shared test helpers. Sizes use distinct primes so a swapped axis fails.

The suite knows its platform. On a GPU:

* float32 matrix products run at ``"highest"`` precision for the whole session (JAX's
  ``jax_default_matmul_precision``; a GPU's default TF32 products miss the float32
  tolerances the tests compare at); tests of TF32 itself set ``precision=`` explicitly;
* tests marked ``cpu_only`` (they assume this machine has no cuDNN, or the CPU's kernel
  choice) are skipped;
* ``pytest -m gpu`` runs the subset worth a device machine's time (lowering, kernels,
  layers; both tiers, since it replaces the default ``-m 'not exhaustive'``).

The platform is read after collection, so a test module may still set ``XLA_FLAGS``
before JAX starts its backends (``test_lowering_sharded.py``).

Compile time. Most of the suite's time is XLA compiling small programs on the CPU. The
session appends :data:`FAST_COMPILE_FLAGS` to ``XLA_FLAGS`` before JAX starts a backend,
so workers and every subprocess a test starts inherit them:

* ``--xla_backend_optimization_level=0``: LLVM's -O0 codegen compiles faster and runs
  slower;
* ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU emits its fusions with its
  established element-wise emitter instead of the newer MLIR fusion emitters, which
  cost most of a small program's compile (small programs compile about twice as fast;
  the suite's wall time fell ~30%);
* ``--xla_cpu_parallel_codegen_split_count=1``: one LLVM module per program instead of
  XLA's default split into many, compiled on a thread pool. The split itself costs, and
  with two workers on two cores there is no idle core for those threads: a small program
  compiled in 25% less time, the suite's wall time fell ~15%. (XLA refuses a split count
  below the number of kernel groups with LLVM options of their own — "Too many extra
  compilation parts" — which only its autotuner sets; a test failing with that message
  only under these flags would be this one.)

The second and third apply only where the installed XLA knows the flag (an unknown flag
aborts XLA; the controller asks a subprocess once per flag).

All three trade generated-code quality or compile parallelism for compile time; XLA
enables no fast-math either way. Results may move in their last bits (on a check of four
engine and kernel outputs at three sizes, the third flag alone moved one blocked-kernel
gradient entry by one float32 ulp; all three against XLA's defaults, a few ulps). The
second is more than codegen: it also selects the HLO passes that go with the old
emitter (XLA:CPU's fusion wrapper and simplification pipeline), so a result may differ in
its last bits and a bug of the default pipeline could hide from the README's command.
Hence CI's exhaustive leg runs at XLA's defaults, as users do
(``STRUCTINFER_TEST_XLA_DEFAULTS=1`` adds none of them; a run with a flag's name already
in ``XLA_FLAGS`` keeps the user's value), and tests about XLA:CPU's default code run
their check in a subprocess with :func:`default_xla_env` (the n = 4097 regression).

Tiers. A large parametrized matrix (every prior x dtype x engine ...) runs its
representatives by default and marks the rest ``exhaustive`` (:func:`matrix`);
``pyproject.toml`` deselects them (``-m 'not exhaustive'``) and CI runs them as a second
leg, ``pytest -m exhaustive``.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

#: the session's shared XLA compilation cache (see ``pytest_configure``)
_CACHE_ENV = "STRUCTINFER_TEST_JAX_CACHE_DIR"

#: appended to ``XLA_FLAGS`` for the test session (see the module docstring): faster
#: compiles of the same programs
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)

#: set (to anything but "" or "0") to run at XLA's default flags
_DEFAULTS_ENV = "STRUCTINFER_TEST_XLA_DEFAULTS"


def xla_flags(*extra: str) -> str:
    """The session's ``XLA_FLAGS`` plus ``extra`` flags (for a subprocess that sets its
    own, e.g. a device count)."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()


def default_xla_env() -> dict:
    """``os.environ`` for a subprocess without the session's :data:`FAST_COMPILE_FLAGS`:
    XLA's default code generation, as users run it."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE_FLAGS]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags))
    return env if flags else {k: v for k, v in env.items() if k != "XLA_FLAGS"}


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (starts JAX's backends: call it from a test
    or a hook, not at import)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def on_hopper() -> bool:
    """Whether JAX's default device is an NVIDIA Hopper GPU (compute capability 9.x), where
    ``"auto"`` takes the Mosaic GPU kernel over the Triton one."""
    return on_gpu() and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


_XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _xla_knows(flag: str) -> bool:
    """Whether the installed XLA accepts ``flag`` (it aborts the process on an unknown
    one): asked of a subprocess that compiles a program on JAX's CPU backend with it."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"  # a compile
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _add_fast_compile_flags() -> None:
    """Append the :data:`FAST_COMPILE_FLAGS` the installed XLA knows and ``XLA_FLAGS``
    does not already set (workers and subprocesses inherit the result)."""
    if os.environ.get(_DEFAULTS_ENV, "") not in ("", "0"):
        return
    flags = os.environ.get("XLA_FLAGS", "").split()
    for flag in FAST_COMPILE_FLAGS:
        name = flag.split("=")[0]
        if any(f.split("=")[0] == name for f in flags):
            continue
        # -O0: every supported XLA knows it; an xdist worker inherits the controller's
        # flags (it left out those its XLA does not know)
        if flag == FAST_COMPILE_FLAGS[0] or (not _XDIST_WORKER and _xla_knows(flag)):
            flags.append(flag)
    os.environ["XLA_FLAGS"] = " ".join(flags)


def pytest_configure(config):
    """Fast-compile flags for the session (see the module docstring), and one
    persistent XLA compilation cache for the whole session, fresh each run.

    Many tests compile the same programs (the same model traced by another test, the
    same eager primitive in another worker, an example run in a subprocess). The
    controller makes an empty folder and names it in the environment, so xdist's workers
    and every subprocess a test starts (``JAX_COMPILATION_CACHE_DIR``) read and write the
    same cache. A cache hit replays the executable XLA built for an identical program: it
    changes compile time only, never a result; nothing outlives the run.
    """
    if not os.environ.get(_CACHE_ENV):  # the controller (or a run without xdist)
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="structinfer-test-xla-")
        config._structinfer_cache_owner = True
    _add_fast_compile_flags()  # before JAX starts a backend
    path = os.environ[_CACHE_ENV]
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if getattr(config, "_structinfer_cache_owner", False):
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


#: the longest tests (tens of seconds to minutes each, most of it tracing and compiling),
#: by node id prefix: run first, so that under ``-n 2`` xdist spreads them over the
#: workers while the many short tests fill the gaps, instead of one of them starting last
#: and leaving a worker alone for its whole run
SLOW_FIRST = (
    "tests/test_cli.py::test_demo_quick",
    "tests/test_bruteforce.py::",
    "tests/test_property.py::test_random_models",
    "tests/test_nn_lm.py::test_quick_run",
    "tests/test_examples.py::test_reproduction_quick",
    "tests/test_snippets.py::test_snippets_run",
    "tests/test_cli.py::test_compare_user_models",
    "tests/test_closed_forms.py::test_gradients_match_closed_form",
    "tests/test_examples.py::test_example_quick",
    "tests/test_mechanisms.py::test_float64_jit_vmap_gradients_match_paper[spatiotemporal]",
    "tests/test_mechanisms.py::test_float64_jit_vmap_gradients_match_paper[renormalised_mixture]",
    "tests/test_lowering_sharded.py::",
    "tests/test_lowering_accel.py::test_pallas_bfloat16_values_and_gradients",
    "tests/test_nn.py::test_equals_flax_multihead_attention",
    "tests/test_lowering_dtype.py::test_layer_dtype_and_param_dtype_as_flax",
    "tests/test_trust.py::test_child_chain_inside_batch_plate",
    "tests/test_markov.py::test_markov_switching_em_counts_and_ascent",
    "tests/test_lowering_accel.py::test_pallas_kernel_interpreted_equals_exact",
    "tests/test_lowering_accel.py::test_pallas_passes_over_many_blocks",
)


def _slow_rank(item) -> int:
    for k, prefix in enumerate(SLOW_FIRST):
        if item.nodeid.startswith(prefix):
            return k
    return len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank)  # stable: the rest keep their order
    if not on_gpu():
        return
    jax.config.update("jax_default_matmul_precision", "highest")
    skip = pytest.mark.skip(reason="assumes a CPU (no cuDNN, the CPU's kernel choice)")
    for item in items:
        if item.get_closest_marker("cpu_only") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """``jax.clear_caches()`` after each test module.

    JAX keeps every program it lowered (and its MLIR context, about a megabyte each) for
    the life of the process; over a worker's thousands of programs that held gigabytes and
    made each new lowering slower (creating a context took 2-4 ms instead of 0.07 ms).
    A module rarely reuses another module's programs, and the session's persistent
    compilation cache turns the few repeats into disk reads: clearing between modules
    measured 5-12 % faster over the suite (clearing after every test was slower).
    """
    yield
    jax.clear_caches()


def eqns_named(jaxpr, name: str, into_kernels: bool = True) -> list:
    """The equations called ``name`` in ``jaxpr`` and every jaxpr nested in its equations'
    parameters (``into_kernels=False``: not inside a ``pallas_call``'s kernel)."""
    out = []
    for eqn in jaxpr.eqns:
        if into_kernels or eqn.primitive.name != "pallas_call":
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    out += eqns_named(inner, name, into_kernels)
        if eqn.primitive.name == name:
            out.append(eqn)
    return out


def numpyro_provenance_works() -> bool:
    """NumPyro's eval_provenance (run by TraceEnum_ELBO) on a function closing over an array:
    it fails on NumPyro 0.21 and older with JAX 0.11.1 and newer (fixed in NumPyro 0.22,
    AssertionError) and on NumPyro 0.15.0 and 0.15.1 with JAX 0.4.31 and newer (KeyError)."""
    import jax.numpy as jnp
    from numpyro.ops.provenance import eval_provenance

    c = jnp.arange(2.0)
    try:
        eval_provenance(lambda z: jnp.sum(c * z), z=jnp.ones(()))
    except (AssertionError, KeyError):
        return False
    return True


def matrix(cases, keep, ids=None):
    """A parametrize list over ``cases``: the representatives (``keep(*case)`` is true)
    run by default, the others carry the ``exhaustive`` marker (CI's second leg,
    ``pytest -m exhaustive``, runs them). A case is a tuple of the arguments, or one
    value that is not a tuple. Each test states its rule beside it: every prior,
    mechanism, case and engine of the matrix stays in the default run at least once."""
    cases = [c if isinstance(c, tuple) else (c,) for c in cases]
    ids = list(ids) if ids is not None else [None] * len(cases)
    return [
        pytest.param(*c, id=i) if keep(*c) else pytest.param(*c, id=i, marks=pytest.mark.exhaustive)
        for c, i in zip(cases, ids)
    ]


@pytest.fixture
def gpu(monkeypatch):
    """The lowering's dispatch sees a GPU (``structinfer.lowering.accel.platform``)."""
    from structinfer.lowering import accel

    monkeypatch.setattr(accel, "platform", lambda: "gpu")


@pytest.fixture
def cudnn_as_xla(monkeypatch):
    """jax.nn's cuDNN attention replaced by its XLA implementation (same arguments), run
    in float32 (the XLA path on a CPU needs it) and answered in the query's dtype.
    Yields the list of calls: the (q, k, v, bias) dtypes of each."""
    import inspect

    from structinfer.lowering import accel

    real = jax.nn.dot_product_attention
    if "return_residual" not in inspect.signature(real).parameters:
        pytest.skip(f"this JAX ({jax.__version__})'s dot_product_attention takes no "
                    "return_residual: no cuDNN kernel to fake")
    calls = []

    def fake(q, k, v, bias=None, *, implementation=None, **kw):
        assert implementation == "cudnn"
        calls.append((q.dtype, k.dtype, v.dtype, None if bias is None else bias.dtype))
        up = lambda x: None if x is None else x.astype(jax.numpy.float32)  # noqa: E731
        y, res = real(up(q), up(k), up(v), up(bias), implementation="xla", **kw)
        return y.astype(q.dtype), res

    monkeypatch.setattr(accel.jax.nn, "dot_product_attention", fake)
    return calls


@contextlib.contextmanager
def float64():
    """Enable float64 inside the block, restoring the previous setting after."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", prev)


@pytest.fixture
def x64():
    """Run a test with float64 enabled (the default elsewhere is float32)."""
    with float64():
        yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def iterate_steps(state, step, energy, max_iters):
    """An algorithm of ``structinfer.infer`` by hand: ``step`` (jitted once) iterated from
    ``state`` in a plain Python loop until it reports convergence or ``max_iters``.

    Returns ``(state, energies, num_steps, converged)``.
    """
    step = jax.jit(step)
    energies, conv, k = [energy(state)], False, 0
    while k < max_iters and not conv:
        state, conv = step(state)
        conv = bool(np.all(conv))
        energies.append(energy(state))
        k += 1
    return state, np.asarray(energies), k, conv


def assert_run_is_iterated_step(run_out, loop_out, rtol=1e-9):
    """``(state, info)`` of an algorithm's ``run`` equals :func:`iterate_steps`: the same
    state, energy trace, step count and reason for stopping."""
    (state, info), (state_ref, energies, k, conv) = run_out, loop_out
    assert int(np.max(info.num_steps)) == k
    assert bool(np.all(info.converged)) == conv
    assert bool(np.all(info.max_iters_reached)) == (not conv)
    assert not bool(np.any(info.nonfinite))
    np.testing.assert_allclose(np.asarray(info.energy)[..., : k + 1], energies.T, rtol=rtol,
                               atol=rtol)
    assert np.all(np.isnan(np.asarray(info.energy)[..., k + 1:]))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol)


def huge_logit_edge(n: int, d: int, dtype, mask=None):
    """A lowered dot-product edge over 2 heads with a per-parent bias: in head 0 every key
    carries a finite ``-1e9`` bias (a fully masked row written as a finite bias), so each
    row's logits are about ``-1e9``, where float32's spacing is 64 and the row max and
    log-normaliser round to the same number; head 1 is ordinary. ``mask``: an optional
    ``(n, n)`` boolean per-edge mask (rows then see different numbers of keys)."""
    import structinfer as si
    from structinfer.lowering._lower import lower_edge

    r = np.random.default_rng(7)
    q, k, v = (jax.numpy.asarray(r.normal(size=(2, n, d)), dtype) for _ in range(3))
    bias = r.normal(size=(2, 1, n)).astype(np.float32)
    bias[0] = -1e9
    prior = si.priors.Categorical(jax.numpy.asarray(bias))
    if mask is not None:
        prior = si.priors.Masked(prior, mask)
    return lower_edge(prior, si.scores.Dot(q, k, scale=d ** -0.5), v, n, (2,))


def float32_softmax(prob, mask=None, scale=None):
    """``(y, L)`` of a plain float32 softmax over ``prob``'s lowered logits $q_i^\\top k_j
    + b_j$ (the reference of the flash kernels on `huge_logit_edge`: its logits are formed
    and rounded as the kernels form them; ``jax.nn.softmax`` and ``logsumexp`` shift by
    the row max, so a row of huge logits stays exact). ``scale``: the lowered site's
    ``terms.dot_scale`` (set for 16-bit operands: the kernels multiply the float32
    $q_i^\top k_j$ by it, ``row.q`` is unscaled)."""
    jnp = jax.numpy
    f32 = jnp.float32
    s = jnp.einsum("...if,...jf->...ij", prob.row.q.astype(f32), prob.col.k.astype(f32),
                   precision="highest")
    if scale is not None:  # the lowered site's ``terms.dot_scale`` (16-bit operands)
        s = s * scale
    s = s + jnp.swapaxes(prob.col.bias.astype(f32), -1, -2)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    y = jnp.einsum("...ij,...jd->...id", jax.nn.softmax(s, -1), prob.v.astype(f32),
                   precision="highest")
    return y, jax.nn.logsumexp(s, -1)


def huge_logit_cotangents(low):
    """A random non-zero cotangent of every output, ``(dy, dL)``, for `huge_logit_edge`."""
    y, lse = float32_softmax(low.problem, scale=low.terms.dot_scale)
    r = np.random.default_rng(11)
    return (jax.numpy.asarray(r.normal(size=y.shape), jax.numpy.float32),
            jax.numpy.asarray(r.normal(size=lse.shape), jax.numpy.float32))


def assert_huge_logit_gradients(got, want, rtol=1e-4):
    """The kernel's gradients ``got`` (a `Problem` of cotangents) equal the reference's
    ``want`` for the queries, keys, per-parent bias and values, each within ``rtol`` of
    its largest magnitude per head (the huge head's and the ordinary head's separately)."""
    for name, a, b in (("dq", got.row.q, want.row.q), ("dk", got.col.k, want.col.k),
                       ("dbias", got.col.bias, want.col.bias), ("dv", got.v, want.v)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        for h in range(b.shape[0]):
            scale = float(np.abs(b[h]).max())
            assert scale > 1e-3, (name, h)
            np.testing.assert_allclose(a[h] / scale, b[h] / scale, atol=rtol,
                                       err_msg=f"{name}, head {h}")


def tilt_model(y, log):
    """Three children copy one of two parents; `log` records each run's edge value (a
    model argument that holds tracers after a fit, not data)."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    import structinfer as si

    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", 3):
        phi = si.edge("phi", si.priors.Uniform(2))
        log.append(phi)
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[phi], s), obs=y)


def return_hop(s1, s2, v, y):
    r"""Two causal hops $i \to j \to k$ ($k \le j \le i$) that must land at most one node
    before the start ($k \ge i - 1$), observing $y_i \sim N(v_k, 1)$. Eliminating $j$
    leaves $\log\sum_j p(j \mid i) p(k \mid j) = -\infty$ for every $k > i$: pairs the two
    hops never connect, while $\log Z$ is finite."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    import structinfer as si

    n = s1.shape[-1]
    with numpyro.plate("nodes", n):
        j = si.edge("hop1", si.priors.Restricted.causal(n), si.scores.Custom(s1))
        k = si.edge("hop2", si.priors.Restricted.causal(n), si.scores.Custom(s2), child=j)
        numpyro.factor("lands_near_start", jnp.where(k >= jnp.arange(n) - 1, 0.0, -jnp.inf))
        numpyro.deterministic("out", v[k])
        numpyro.sample("y", dist.Normal(v[k], 1.0), obs=y)


def return_hop_brute(s1, s2, v, y):
    """log Z, the marginals of both hops and E[v_k] of `return_hop`, in NumPy float64, by
    summing every pair (j, k) for every node i (the first hop weighs prior x e^score,
    the followed hop is its row's softmax: `si.edge`'s ``child=``)."""
    from scipy.special import log_softmax, logsumexp
    from scipy.stats import norm

    s1, s2, v, y = (np.asarray(a, np.float64) for a in (s1, s2, v, y))
    n = s1.shape[-1]
    i, j, k = np.ogrid[:n, :n, :n]
    with np.errstate(divide="ignore"):
        log_p = np.log(np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None])  # causal prior
        hop2 = log_softmax(log_p + s2, axis=1)  # a followed hop: its normalised conditional
        w = (log_p[i, j] + s1[i, j] + hop2[j, k] + norm.logpdf(y[i], v[k], 1.0)
             + np.log(k >= i - 1))  # (node i, hop1 j, hop2 k)
    per_node = logsumexp(w, axis=(1, 2))
    post = np.exp(w - per_node[:, None, None])
    return per_node.sum(), post.sum(2), post.sum(1), post.sum(1) @ v


@contextlib.contextmanager
def lowered_programs():
    """The programs JAX lowers (traces to MLIR) while the block runs, from its
    ``jax.monitoring`` events: a call that reuses a compiled program adds none. On leaving,
    a sentinel program must be heard, so a renamed event cannot make the list empty."""
    event = "/jax/core/compile/jaxpr_to_mlir_module_duration"
    seen = []

    def listen(name, duration, **_):
        if name == event:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
        n = len(seen)
        jax.jit(lambda x: x * 3.5 - 1.25)(np.arange(7.0))  # a new function: a new program
        assert len(seen) > n, f"no {event} event heard for a new program"
        del seen[n:]
    finally:
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:
            unregister(listen)
