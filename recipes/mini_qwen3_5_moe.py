"""Train a mini Qwen3.5-MoE (gated DeltaNet and gated attention 3:1, 16 experts top-4 + shared).

    python recipes/mini_qwen3_5_moe.py                  # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_qwen3_5_moe.py --steps 1000 --load-balance document
    python recipes/mini_qwen3_5_moe.py --help           # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (the linear and full attention layers see 4-way context
parallelism, the MoE 2-way expert parallelism), the built-in corpus (the Python standard
library's sources, byte tokens). On GPUs/TPUs it uses the real devices with FSDP. Rerunning the
same command resumes from ``runs/mini_qwen3_5_moe/checkpoints``; SIGTERM/Ctrl-C saves and exits.
The run ends with a greedy sample (`zoo.inference`: each linear layer's recurrent state and
convolution window, the full layers' K/V).
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_qwen3_5_moe",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="qwen3_5_moe", preset="mini",  # zoo.models.registry; --set FIELD=VALUE
        steps=200, batch_size=8, seq_len=256,
        lr=3e-3,                         # peak; warmup min(100, steps/10), cosine to 10%
        checkpoint_every=50,
    ),
)


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    cli.run(RECIPE)
