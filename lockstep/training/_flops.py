"""`matmul_flops`: the FLOPs of a program's matrix products and convolutions, counted from its jaxpr.

The count MFU is conventionally taken from (PaLM's): 2 x M x N x K a product, 2 x (outputs) x
(kernel elements per output) a convolution, and for a fused attention kernel (cuDNN's, which
Keras' attention uses on GPUs) its two products forward and four backward, each 2 x queries x
keys x head size; element-wise work is left out. What the program computes is what counts: a
forward pass that activation checkpointing (`remat`) recomputes counts twice (hardware FLOPs,
up to 4/3 of the model's), the fused kernel's own recomputation not. Every turn of a `scan`
counts (a step of `steps_per_execution`, a batch of gradient accumulation); a `while` loop's body,
whose trip count is not known, once; a `cond`, its costliest branch. Inside a `shard_map` the
shapes are one shard's, counted once per shard, so the result is the whole program's over all its
devices. XLA's own cost analysis was not used: it counts a loop's body once, and on GPU it misses
the matrix products that the compiler hands to cuBLAS (a GPT-2-small step on an H100: 7.9e11 of
its ~7e12).

>>> import jax, jax.numpy as jnp
>>> def two_steps(x, w):
...     return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=2)[0]
>>> matmul_flops(jax.make_jaxpr(two_steps)(jnp.ones((4, 3)), jnp.ones((3, 3))))
144.0
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core

_BNTH = 1  # `layout` of jax's cuDNN attention primitives: 0 = (batch, sequence, heads, size), 1 = (b, h, s, size)


def matmul_flops(jaxpr: Any) -> float:
    """FLOPs of the matrix products and convolutions of `jaxpr` (a `ClosedJaxpr` or `Jaxpr`)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            per_output = math.prod(rhs) / rhs[params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * per_output
        elif name.startswith("dot_product_attention") and ("fwd" in name or "bwd" in name):
            query, key = (v.aval.shape for v in eqn.invars[:2])
            keys = key[2] if params.get("layout") == _BNTH else key[1]  # (batch, heads, keys, size) or (b, k, h, s)
            total += (4.0 if "fwd" in name else 8.0) * math.prod(query) * keys
        elif name == "scan":
            total += params["length"] * matmul_flops(params["jaxpr"])
        elif name == "cond":
            total += max(matmul_flops(branch) for branch in params["branches"])
        elif name == "shard_map":
            mesh = params["mesh"]
            manual = next((params[k] for k in ("newly_manual_axes", "manual_axes") if k in params), mesh.axis_names)
            total += math.prod(mesh.shape[a] for a in manual) * matmul_flops(params["jaxpr"])
        else:  # jit, remat, custom_jvp / custom_vjp calls, a while loop's body and condition: once
            total += sum(matmul_flops(sub) for sub in core.jaxprs_in_params(params))
    return total
