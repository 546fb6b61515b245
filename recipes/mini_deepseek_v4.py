"""Train a mini DeepSeek-V4 (sliding, CSA and HCA attention on 4 hyper-connection streams; a
hash-routed first MoE layer, sqrtsoftplus routing with a selection bias after it).

    python recipes/mini_deepseek_v4.py                   # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_deepseek_v4.py --set index_topk=16
    python recipes/mini_deepseek_v4.py --strategy fsdp
    python recipes/mini_deepseek_v4.py --set index_stage=warmup   # train the CSA indexers
    python recipes/mini_deepseek_v4.py --help            # every setting, with its default

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism: compression windows
that straddle shards are completed from the neighbours, the CSA indexer's top-k is global),
the built-in corpus (the Python standard library's sources, byte tokens). The hash layer's
token -> experts table stays at zoo's initial one (`zoo.layers.moe.hash_table_init`: token
``t`` to experts ``(t * k + j) % E``; a checkpoint brings DeepSeek's), and the indexer's
selection is under ``stop_gradient`` (``--set index_stage=warmup``, then ``sparse``: the
indexers learn the main attention's distribution over the compressed entries, as DeepSeek-V3.2
trains its own). The run ends with a greedy sample (`zoo.inference`: each
layer's sliding ring, compressed entries and open windows). On GPUs/TPUs it uses the real
devices with FSDP. Rerunning the
same command resumes from ``runs/mini_deepseek_v4/checkpoints``; SIGTERM/Ctrl-C saves and
exits.
"""

from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

RECIPE = cli.Recipe(
    name="mini_deepseek_v4",
    description=cli.first_paragraph(__doc__),
    train=TrainConfig(
        family="deepseek_v4", preset="mini",   # zoo.models.registry; --set FIELD=VALUE
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
