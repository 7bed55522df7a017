import jax, jax.numpy as jnp
import structinfer as si
a=jnp.full((3,3),1/3)
try: print(jax.jit(lambda a,m: si.diagnostics.effective_window(a,0,m))(a,0.9))
except Exception as e: print("effective_window traced mass:", type(e).__name__, str(e)[:150])
try: print(jax.jit(lambda s,m: si.infer.geometric_beta(s,0.1,0.9,mass=m)[0].window)(a,0.9))
except Exception as e: print("geometric_beta traced mass:", type(e).__name__, str(e)[:150])
