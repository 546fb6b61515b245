"""Train a mini Qwen3-MoE (GQA attention with q/k norms, 16 experts top-4, softmax router).

    python recipes/mini_qwen3_moe.py                   # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_qwen3_moe.py --steps 1000 --set norm_topk_prob=false
    python recipes/mini_qwen3_moe.py --set decoder_sparse_step=2   # dense and MoE alternate
    python recipes/mini_qwen3_moe.py --help            # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism, the MoE 2-way expert
parallelism), the built-in corpus (the Python standard library's sources, byte tokens), a few
minutes on 2 cores. On GPUs/TPUs it uses the real devices with FSDP. Rerunning the same
command resumes from ``runs/mini_qwen3_moe/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_qwen3_moe",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="qwen3_moe", preset="mini",   # zoo.models.registry; --set FIELD=VALUE
        steps=200, batch_size=8, seq_len=256,
        lr=3e-3,                         # peak; warmup min(100, steps/10), cosine to 10%
        checkpoint_every=50,             # the load-balance loss weight: the config's own
    ),
)


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    cli.run(RECIPE)
