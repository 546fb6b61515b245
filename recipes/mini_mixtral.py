"""Train a mini Mixtral (GQA attention, 8 experts top-2, softmax router + load-balance loss).

    python recipes/mini_mixtral.py                     # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_mixtral.py --steps 1000 --set num_local_experts=16
    python recipes/mini_mixtral.py --help              # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism, the MoE 2-way expert
parallelism), the built-in corpus (the Python standard library's sources, byte tokens), a few
minutes on 2 cores. On GPUs/TPUs it uses the real devices with FSDP. Rerunning the same
command resumes from ``runs/mini_mixtral/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_mixtral",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="mixtral", preset="mini",   # zoo.models.registry; --set FIELD=VALUE
        steps=200, batch_size=8, seq_len=256,
        lr=3e-3,                         # peak; warmup min(100, steps/10), cosine to 10%
        checkpoint_every=50,             # the load-balance loss weight: the config's own
    ),
)


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    cli.run(RECIPE)
