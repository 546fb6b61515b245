"""Train a mini GLM-5 (DeepSeek-V3.2's mini with GLM-5's indexer and cross-layer top-k sharing:
the indexers of the 5 layers alternate full and shared, each shared layer attending to the 64
keys the full layer before it chose).

    python recipes/mini_glm_moe_dsa.py                  # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_glm_moe_dsa.py --set index_topk=32
    python recipes/mini_glm_moe_dsa.py --help           # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism: the index keys and
the latents are all-gathered, the top-k is global and travels to the shared layers with its
queries), the built-in corpus (the Python standard library's sources, byte tokens). The
indexers' selection is under ``stop_gradient``, as in transformers: their parameters keep
their initial values here. On GPUs/TPUs it uses the real devices with FSDP. Rerunning the same
command resumes from ``runs/mini_glm_moe_dsa/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_glm_moe_dsa",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="glm_moe_dsa", preset="mini",   # zoo.models.registry; --set FIELD=VALUE
        overrides=("num_nextn_predict_layers=1",),  # as GLM-5 is published: one MTP module
        steps=200, batch_size=8, seq_len=256,
        lr=3e-3,                               # peak; warmup min(100, steps/10), cosine to 10%
        checkpoint_every=50,
        expert_bias_rate=1e-2,                 # as recipes/mini_deepseek_v32.py
    ),
)


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    cli.run(RECIPE)
