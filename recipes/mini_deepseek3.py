"""Train a mini DeepSeek-V3 (MLA, 16 routed experts + 1 shared, aux-loss-free balancing, one
multi-token-prediction module).

    python recipes/mini_deepseek3.py                     # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_deepseek3.py --steps 1000 --set hidden_size=256
    python recipes/mini_deepseek3.py --help              # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism, the MoE 2-way expert
parallelism), the built-in corpus (the Python standard library's sources, byte tokens), a few
minutes on 2 cores. On GPUs/TPUs it uses the real devices with FSDP. Rerunning the same
command resumes from ``runs/mini_deepseek3/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_deepseek3",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="deepseek3", preset="mini",   # zoo.models.registry; --set FIELD=VALUE
        overrides=("num_nextn_predict_layers=1",),  # as DeepSeek-V3 trains: one MTP module
        steps=200, batch_size=8, seq_len=256,
        lr=3e-3,                             # peak; warmup min(100, steps/10), cosine to 10%
        checkpoint_every=50,
        # aux-loss-free balancing: a 200-step run needs a faster bias than DeepSeek's 1e-3 to
        # balance visibly (busiest expert / mean 2.38 -> 1.13 at 1e-2, same loss)
        expert_bias_rate=1e-2,
    ),
)


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    cli.run(RECIPE)
