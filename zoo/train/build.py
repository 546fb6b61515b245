"""The one builder: a `TrainConfig` -> model factory, optimizer, train step, batch sharding, data.

`build(config)` is how everything that trains or compiles a train step starts: the recipes'
command line, the `Trainer`, `rehearse`, the benchmarks and the accelerator check. It

1. makes the model config, once: the family's preset from the registry
   (`zoo.models.registry`: ``config.family`` and ``config.preset``) or a model config handed
   in, then ``config.overrides`` (``--set`` and the flags that spell it: ``--dtype``,
   ``--param-dtype``, ``--remat``, ``--attention``) -- `choose_model`; then the data's token
   layout, the platform's default dtype, the tokenizer's vocabulary and a Hugging Face
   checkpoint's config.json (``--from-hf``) -- `resolve_model_config`;
2. resolves the devices' platform, the mesh and the strategy (defaults: the EP-as-CP showcase
   on CPU devices, FSDP on accelerators) into a `zoo.Partitioner`;
3. checks shapes against the mesh by building the model abstractly, so a bad batch, length or
   mesh is a `ValueError` here, before anything is compiled;
4. makes the optimizer (`make_tx` from the optimizer section, or the caller's optax
   transformation), the schedule and the jitted train step (aux-loss weight from the config,
   the family's after-step hook);
5. builds this process's data iterator (`zoo.data.text_dataset`) unless asked not to.

Every failure is a `ValueError` naming the setting, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from zoo.models import registry
from zoo.train.config import TrainConfig
from zoo.train.fields import apply_overrides, config_to_json, config_to_python

__all__ = ["Built", "ModelChoice", "build", "choose_model", "resolve_model_config",
           "class_path", "LOAD_BALANCE_LAYOUT", "PLATFORM_DTYPE"]

# --load-balance -> the token layout on the context shards (`zoo.ops.attention(layout=)`): "row"
# deals each row's 2*cp chunks as r, 2cp-1-r; "auto"/"document" permute per row, so no static
# layout holds.
LOAD_BALANCE_LAYOUT = {"none": "contiguous", "row": "balanced", "auto": None, "document": None}

# The platform default: GPUs and TPUs (and their rehearsal, ``--rehearse``) compute in bfloat16
# over the model config's parameter dtype unless the dtype is set (``--dtype``, ``--set
# dtype=``, an ``overrides`` item). On CPU the model config's dtype stands. Applied in
# `resolve_model_config` only.
PLATFORM_DTYPE = "bfloat16"


@dataclasses.dataclass(kw_only=True)
class Built:
    """What `build` returns: everything a training run or a compiled step needs."""

    config: TrainConfig              # strategy, mesh, warmup, aux weight resolved
    family: registry.Family
    model_cls: type
    model_config: Any                # after --set, the platform's dtype, --from-hf
    partitioner: Any                 # zoo.Partitioner
    make_model: Callable[[], Any]    # builds the model sharded (call under jax.jit)
    tx: Any                          # optax transformation
    schedule: Callable[[int], float] | None  # host-side rate of update t (None: the tx's own)
    train_step: Callable             # jitted (model, optimizer, batch, lr) -> (..., metrics)
    batch_sharding: Any              # NamedSharding of the global [batch, seq_len] arrays
    data: Any = None                 # this process's checkpointable batch iterator
    data_files: list[str] | None = None  # the --data files it reads (None: built-in corpus)
    tokenizer: Any = None
    flops_per_token: float | None = None
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # what run.json holds
    create: Callable[[], tuple[Any, Any]] | None = None  # a fresh run's (model, optimizer)
    custom_tx: bool = False

    @property
    def mesh(self):
        return self.partitioner.mesh

    def abstract_state(self):
        """``(model, optimizer)`` as shapes and shardings (`zoo.train.step.abstract_state`)."""
        from zoo.train import step as step_lib
        return step_lib.abstract_state(self.make_model, self.tx, self.mesh)

    def create_sharded(self):
        """``(model, optimizer)`` as a fresh run starts them (created on their shards)."""
        from zoo.train import step as step_lib
        return self.create() if self.create else step_lib.create_sharded(self.make_model,
                                                                           self.tx)

    def batch_abstract(self) -> dict[str, Any]:
        """The global batch as `jax.ShapeDtypeStruct`s on the batch sharding."""
        import jax
        import numpy as np

        from zoo.train.step import BATCH_KEYS
        shape = (self.config.batch_size, self.config.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, np.float32 if k == "loss_weights" else np.int32,
                                        sharding=self.batch_sharding) for k in BATCH_KEYS}

    def eval_data(self, paths: Sequence[str] | None = None):
        """This process's batches of the held-out documents (`zoo.data.split`), once through,
        in a fixed order; or of every document of `paths`. A fresh iterator each call."""
        return _data(self.config, self.partitioner, self.batch_sharding, self.tokenizer,
                     split="validation" if paths is None else "train", paths=paths)[0]


# -- the model ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """The model as the settings name it (`choose_model`): a family and its config, the
    preset (or a config handed in) with the settings' ``overrides`` applied. `build` completes
    it for the devices, the data and the checkpoint (`resolve_model_config`)."""

    family: registry.Family
    config: Any
    overrides: tuple[str, ...]  # the TrainConfig.overrides applied


def choose_model(config: TrainConfig, model_config: Any = None) -> ModelChoice:
    """The family and model config of `config`: `model_config` (else ``config.family``'s
    ``config.preset``, default ``mini``), then ``config.overrides`` (``--set`` and the flags
    that spell it). Bad overrides are a `ValueError` naming the field and the fix. The
    recipes' command line calls it once, when it parses the flags, and hands the result to
    `build`."""
    if model_config is not None:
        family = registry.family_of(model_config)
    else:
        if config.family is None:
            raise ValueError(f"TrainConfig.family is not set: pass family= (one of "
                             f"{', '.join(registry.names())}) and preset=, or a model config")
        family = registry.get(config.family)
        model_config = family.preset(config.preset or "mini")
    try:
        chosen = apply_overrides(model_config, config.overrides)
    except ValueError as e:
        raise ValueError(str(e)) from None
    return ModelChoice(family, chosen, tuple(config.overrides))


def _set_fields(overrides) -> frozenset[str]:
    """The model config fields an ``overrides`` list sets."""
    return frozenset(o.partition("=")[0].strip() for o in overrides)


def resolve_model_config(config: TrainConfig, model_config: Any, *, platform: str,
                         tokenizer: Any = None, model_cls: type | None = None) -> Any:
    """`model_config` (`choose_model`'s, the overrides applied) completed for this run: the
    data's token layout (``--load-balance``), the platform's default dtype (`PLATFORM_DTYPE`),
    the tokenizer's vocabulary and ``--from-hf`` (whose config.json gives the fields not
    set). A field the overrides set is never changed here."""
    import jax.numpy as jnp
    given = _set_fields(config.overrides)
    changes: dict[str, Any] = {}
    if "attention_layout" not in given:  # the order the data pipeline gives the shards
        changes["attention_layout"] = LOAD_BALANCE_LAYOUT[config.load_balance]
    if "dtype" not in given and (platform != "cpu" or config.rehearse):
        changes["dtype"] = jnp.dtype(PLATFORM_DTYPE).type
    vocab = getattr(tokenizer, "vocab_size", 0)
    if vocab > model_config.vocab_size and "vocab_size" not in given:
        changes["vocab_size"] = -(-vocab // 128) * 128
    elif vocab > model_config.vocab_size:
        raise ValueError(f"--set vocab_size={model_config.vocab_size} is smaller than the "
                         f"tokenizer's {vocab} ids")
    if config.from_hf:
        from zoo.models import hf
        model_cls = model_cls or registry.family_of(model_config).model_cls
        raw = hf.read_config(config.from_hf, model_cls.hf_model_types, loader="--from-hf")
        overrides = {k: getattr(model_config, k) for k in given} | changes
        return type(model_config).from_hf_config(raw, **overrides)
    return dataclasses.replace(model_config, **changes) if changes else model_config


def _aux_weight(config: TrainConfig, model_config: Any) -> float:
    if config.aux_loss_weight is not None:
        return float(config.aux_loss_weight)
    field = config.aux_loss_field or model_config.aux_loss_field
    if field is None:
        return 0.0
    names = [f.name for f in dataclasses.fields(model_config)]
    if field not in names:
        numeric = [n for n in names if isinstance(getattr(model_config, n), float)]
        raise ValueError(f"--aux-loss-field {field}: {type(model_config).__name__} has no such "
                         f"field; valid fields holding a weight: {', '.join(numeric)}")
    return float(getattr(model_config, field))


# -- devices and mesh --------------------------------------------------------------------------

def _partitioner(config: TrainConfig, devices: Sequence[Any] | None):
    import jax

    from zoo.partitioning import MeshShape, Partitioner, device_platform
    from zoo.train.launch import default_mesh
    devices = list(devices) if devices is not None else jax.devices()
    platform = device_platform(devices[0])
    mesh_text = config.mesh or default_mesh(len(devices), platform)
    strategy = config.strategy or ("ep_as_cp" if platform == "cpu" else "fsdp")
    shape = MeshShape.parse(mesh_text)
    try:
        mesh = shape.make(devices=devices)
    except ValueError as e:
        raise ValueError(f"--mesh {mesh_text}: {e}") from None
    return Partitioner(mesh, strategy), mesh_text, strategy, platform


# -- the builder -------------------------------------------------------------------------------

def build(config: TrainConfig, *, model_config: Any = None, model_cls: type | None = None,
          decoder_layer_cls: type | None = None, tx: Any = None,
          schedule: Callable[[int], float] | None = None, devices: Sequence[Any] | None = None,
          with_data: bool = True, donate: bool | None = None) -> Built:
    """Turn `config` into a `Built` (see the module docstring).

    Args:
      model_config: a family config to use instead of ``config.family``/``config.preset``
        (``config.overrides`` still apply), or a `ModelChoice` of `config` (`choose_model`,
        the overrides applied already: the recipes' command line resolves them once, when it
        parses the flags).
      model_cls, decoder_layer_cls: a model (sub)class instead of the family's, a decoder
        layer class handed to it.
      tx, schedule: an optax transformation instead of `make_tx`, and (optionally) the
        schedule it follows, for logging the rate it applies.
      devices: the devices of the mesh (default `jax.devices()`).
      with_data: build the data iterator (``False`` for a rehearsal or a benchmark).
      donate: the train step's donation (default: on accelerators).
    """
    import jax

    from zoo.train import step as step_lib
    chosen = model_config if isinstance(model_config, ModelChoice) else choose_model(
        config, model_config)
    if chosen.overrides != tuple(config.overrides):
        raise ValueError(f"build: the ModelChoice applied the overrides {list(chosen.overrides)}"
                         f", the config has {list(config.overrides)}; pass "
                         f"choose_model(config) of this config")
    family, model_config = chosen.family, chosen.config
    model_cls = model_cls or family.model_cls
    partitioner, mesh_text, strategy, platform = _partitioner(config, devices)
    tokenizer = _tokenizer(config)
    model_config = resolve_model_config(config, model_config, platform=platform,
                                        tokenizer=tokenizer, model_cls=model_cls)
    warmup = step_lib.default_warmup(config.steps) if config.warmup is None else config.warmup
    config = config.replace(mesh=mesh_text, strategy=strategy, warmup=warmup,
                            family=config.family or family.name,
                            aux_loss_weight=_aux_weight(config, model_config))
    B, L = config.batch_size, config.seq_len
    batch_sharding = partitioner.sharding(("batch", "length"))
    kwargs = {"decoder_layer_cls": decoder_layer_cls} if decoder_layer_cls is not None else {}

    def make_model():
        from flax import nnx
        return model_cls(model_config, inputs_shape=(B, L), partitioner=partitioner,
                         rngs=nnx.Rngs(config.seed), **kwargs)

    abstract = _check_shapes(make_model, batch_sharding, config)
    custom_tx = tx is not None
    if tx is None:
        tx = step_lib.make_tx(weight_decay=config.weight_decay, b1=config.adam_b1,
                              b2=config.adam_b2, eps=config.adam_eps, clip=config.clip)
        schedule = step_lib.lr_schedule(config.lr, config.steps, warmup=warmup,
                                        final_fraction=config.final_lr_fraction)
    bias_rate = config.expert_bias_rate if family.after_step is not None else 0.0
    train_step = step_lib.make_train_step(  # a custom tx logs the rate its schedule gives
        aux_loss_weight=config.aux_loss_weight, expert_bias_rate=bias_rate, donate=donate,
        platform=platform,
        schedule=schedule if custom_tx else None)
    data, data_files = (_data(config, partitioner, batch_sharding, tokenizer) if with_data
                        else (None, None))
    if with_data and config.eval_every:  # an empty held-out split is refused before compiling
        _data(config, partitioner, batch_sharding, tokenizer, split="validation")[0].close()
    return Built(config=config, family=family, model_cls=model_cls, model_config=model_config,
                 partitioner=partitioner, make_model=make_model, tx=tx, schedule=schedule,
                 train_step=train_step, batch_sharding=batch_sharding, data=data,
                 data_files=data_files,
                 tokenizer=tokenizer, custom_tx=custom_tx,
                 flops_per_token=model_config.flops_per_token(L),
                 create=_from_hf(config, model_cls, model_config, partitioner, tx, kwargs),
                 record=_record(family, model_cls, decoder_layer_cls, model_config, partitioner,
                                abstract, data, custom_tx, jax.process_count()))


def _tokenizer(config: TrainConfig):
    from zoo.train import validate
    return validate.load_tokenizer(config.tokenizer)


def _check_shapes(make_model, batch_sharding, config: TrainConfig):
    """Build the model abstractly so shape and mesh errors surface as setting errors."""
    from flax import nnx

    from zoo.train import step as step_lib
    B, L = config.batch_size, config.seq_len
    try:
        step_lib.check_process_layout(batch_sharding, (B, L))
        return nnx.eval_shape(make_model)
    except ValueError as e:
        raise ValueError(f"{e} (mesh {config.mesh}, strategy {config.strategy}, batch {B}, "
                         f"seq_len {L})") from None


def _data(config: TrainConfig, partitioner, batch_sharding, tokenizer, *,
          split: str = "train", paths: Sequence[str] | None = None):
    """A batch iterator of this process and the files it reads (None: built-in): the training
    stream, the held-out documents once through (``split="validation"``), or every document
    of `paths` once through."""
    import jax

    from zoo import data as data_lib
    from zoo.train import validate
    B, L = config.batch_size, config.seq_len
    if B % jax.process_count():
        raise ValueError(f"--batch-size {B} must be divisible by the {jax.process_count()} "
                         f"processes")
    other = paths is not None  # not the run's corpus: every document counts
    paths = tuple(paths) if other else config.data_files
    files = validate.check_data(paths)
    return data_lib.text_dataset(
        list(paths) if paths else None, seq_len=L, batch_size=B,
        context_parallel=partitioner.context_size("attention"), balance=config.load_balance,
        rows_per_device=batch_sharding.shard_shape((B, L))[0], corpus_docs=config.corpus_docs,
        validation_fraction=0.0 if other else config.validation_fraction, split=split,
        num_epochs=1 if other or split == "validation" else None, tokenizer=tokenizer,
        seed=config.seed), files


def _from_hf(config: TrainConfig, model_cls, model_config, partitioner, tx, kwargs):
    """A fresh run's ``(model, optimizer)`` from ``--from-hf`` (None: random weights)."""
    if not config.from_hf:
        return None

    def create():
        import jax
        from flax import nnx
        fields = {k: v for k, v in config_to_python(model_config).items()
                  if k not in ("dtype", "param_dtype")}
        model = model_cls.from_hf(
            config.from_hf, partitioner=partitioner, inputs_shape=(config.batch_size,
                                                                   config.seq_len),
            dtype=model_config.dtype, param_dtype=model_config.param_dtype,
            config_overrides=fields, **kwargs)
        return model, jax.jit(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param))(model)

    return create


def class_path(cls: type | None) -> str | None:
    """``module:QualName``, how run.json names a class so `zoo.train.load` can import it
    again (None for None)."""
    return None if cls is None else f"{cls.__module__}:{cls.__qualname__}"


def _record(family, model_cls, decoder_layer_cls, model_config, partitioner, abstract, data,
            custom_tx: bool, processes: int) -> dict[str, Any]:
    """What run.json and each checkpoint record beside the settings."""
    from zoo.layers.moe import moe_modules  # the MoE kernels as resolved for this mesh
    # the first MoE layer's `zoo.ops.moe_execution.MoEExecution` (kernel, reason for a fallback)
    moe = next((m.execution.as_dict() for m in moe_modules(abstract, with_bias=False)), None)
    return dict(family=family.name, model_cls=class_path(model_cls),
                decoder_layer_cls=class_path(decoder_layer_cls),
                model=config_to_json(model_config),
                context_parallel=partitioner.context_size("attention"), moe=moe,
                optimizer="custom" if custom_tx else "zoo.train.step.make_tx",
                data_arguments=dict(getattr(data, "arguments", None) or {}) or None)
