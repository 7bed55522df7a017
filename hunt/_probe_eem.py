import jax, jax.numpy as jnp, numpy as np
import structinfer as si
E = lambda v, th: jnp.sum((v - th) ** 2) + 0.1 * jnp.sum(th ** 2)
for th in (jnp.array([1, 2]), jnp.array([1., 2.])):
    try:
        st, info = si.infer.energy_em(E, jnp.zeros(2), th, max_iters=500, m_step_size=0.1)
        print(th.dtype, "ok", np.asarray(st.params), np.asarray(st.latents), float(st.energy), bool(info.converged))
    except Exception as e: print(th.dtype, type(e).__name__, str(e)[:200])
