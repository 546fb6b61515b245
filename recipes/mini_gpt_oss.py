"""Train a mini gpt-oss (sliding/full attention alternating, sinks, biased clamped-SwiGLU experts).

    python recipes/mini_gpt_oss.py                     # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_gpt_oss.py --steps 1000 --set sliding_window=64
    python recipes/mini_gpt_oss.py --set swiglu_limit=3.0    # a tighter expert clamp
    python recipes/mini_gpt_oss.py --help              # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism, the MoE 2-way expert
parallelism), the built-in corpus (the Python standard library's sources, byte tokens), a few
minutes on 2 cores. The sliding layers' ring moves only the hops their window can see (the
recipe sets the data layout from --load-balance). Rerunning the same command resumes from
``runs/mini_gpt_oss/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_gpt_oss",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="gpt_oss", preset="mini",     # zoo.models.registry; --set FIELD=VALUE
        steps=200, batch_size=8, seq_len=256,
        lr=3e-3,                         # peak; warmup min(100, steps/10), cosine to 10%
        checkpoint_every=50,             # aux-loss weight: router_aux_loss_coef (mini: 0.01)
    ),
)


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    cli.run(RECIPE)
