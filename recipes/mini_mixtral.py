"""Train a mini Mixtral (GQA attention, 8 experts top-2, softmax router + load-balance loss).

    python recipes/mini_mixtral.py                     # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_mixtral.py --steps 1000 --set num_local_experts=16
    python recipes/mini_mixtral.py --help              # every flag (= every TrainConfig field)

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism, the MoE 2-way expert
parallelism), the built-in corpus (the Python standard library's sources, byte tokens), a few
minutes on 2 cores. On GPUs/TPUs it uses the real devices with FSDP. Rerunning the same
command resumes from ``runs/mini_mixtral/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.models.mixtral import Mixtral, MixtralConfig
from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

# -- config -----------------------------------------------------------------------------------
MODEL = MixtralConfig.mini()            # --set FIELD=VALUE overrides any field
TRAIN = TrainConfig(                    # every field is a flag: --steps, --seq-len, ...
    steps=200,                          # planned total; fixes the learning-rate schedule
    batch_size=8,                       # global rows
    seq_len=256,
    lr=3e-3,                            # peak; warmup min(100, steps/10), cosine to 10%
    checkpoint_every=50,
    aux_loss_field="router_aux_loss_coef",  # Switch-style load-balance loss weight
)
RECIPE = cli.Recipe(name="mini_mixtral", model_cls=Mixtral, config=MODEL, train=TRAIN,
                    description=__doc__.split("\n")[0])


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    raise SystemExit(main())
