"""Train a mini DeepSeek-V3.2 (DeepSeek-V3's mini with DSA: each query attends to the 64 keys
its lightning indexer ranks best; one multi-token-prediction module).

    python recipes/mini_deepseek_v32.py                  # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_deepseek_v32.py --set index_topk=32
    python recipes/mini_deepseek_v32.py --set index_stage=warmup   # train the indexer
    python recipes/mini_deepseek_v32.py --help           # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism: the index keys and
the latents are all-gathered, the top-k is global), the built-in corpus (the Python standard
library's sources, byte tokens). The indexer's selection is under ``stop_gradient``, as in
DeepSeek's inference: its parameters keep their initial values here. On GPUs/TPUs it uses the
real devices with FSDP. Rerunning the same command resumes from
``runs/mini_deepseek_v32/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_deepseek_v32",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="deepseek_v32", preset="mini",  # zoo.models.registry; --set FIELD=VALUE
        overrides=("num_nextn_predict_layers=1",),  # as DeepSeek-V3 trains: one MTP module
        steps=200, batch_size=8, seq_len=256,
        lr=3e-3,                               # peak; warmup min(100, steps/10), cosine to 10%
        checkpoint_every=50,
        expert_bias_rate=1e-2,                 # as recipes/mini_deepseek3.py
    ),
)


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    cli.run(RECIPE)
