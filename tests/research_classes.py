"""Research subclasses that tests train and load back (importable as ``research_classes``:
pytest puts ``tests/`` on the path), so run.json names them by an importable path.

* `TemperedLayer` -- method only: its router's logits at temperature 2 (the input to the
  router halved; the logits are linear in it), no new state.
* `ScaledRouterLayer` -- new state: a learned scale of the router's input, one parameter per
  layer that the checkpoint holds.
"""

import jax.numpy as jnp
from flax import nnx

from zoo.models.mixtral import MixtralDecoderLayer, MixtralMoE


class TemperedMoE(MixtralMoE):
    temperature = 2.0

    def route(self, x):
        return super().route(x / self.temperature)


class TemperedLayer(MixtralDecoderLayer):
    moe_cls = TemperedMoE


class ScaledRouterMoE(MixtralMoE):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.router_scale = nnx.Param(jnp.full((), 0.5, jnp.float32))

    def route(self, x):
        return super().route(x * self.router_scale[...])


class ScaledRouterLayer(MixtralDecoderLayer):
    moe_cls = ScaledRouterMoE
