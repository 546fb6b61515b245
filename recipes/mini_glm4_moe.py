"""Train a mini GLM-4.5 (GQA with q/k/v biases, q/k norms, half-rotary heads; sigmoid-routed MoE).

    python recipes/mini_glm4_moe.py                    # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_glm4_moe.py --steps 1000 --set use_qk_norm=false   # GLM-4.5-Air-like
    python recipes/mini_glm4_moe.py --set partial_rotary_factor=1.0        # every dim rotates
    python recipes/mini_glm4_moe.py --help             # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism, the MoE 2-way expert
parallelism), the built-in corpus (the Python standard library's sources, byte tokens), a few
minutes on 2 cores. The routers' selection bias is updated after every step (aux-loss-free
balancing, as DeepSeek-V3's). Rerunning the same command resumes from
``runs/mini_glm4_moe/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_glm4_moe",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="glm4_moe", preset="mini",    # zoo.models.registry; --set FIELD=VALUE
        steps=200, batch_size=8, seq_len=256,
        lr=3e-3,                         # peak; warmup min(100, steps/10), cosine to 10%
        checkpoint_every=50,
        expert_bias_rate=1e-2,           # the routers' selection bias, as mini_deepseek3
    ),
)


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    cli.run(RECIPE)
