"""Train a mini DeepSeek-V3 (MLA, 16 routed experts + 1 shared, aux-loss-free balancing).

    python recipes/mini_deepseek3.py                     # 8 virtual CPU devices, EP-as-CP
    python recipes/mini_deepseek3.py --steps 1000 --set hidden_size=256
    python recipes/mini_deepseek3.py --help              # every flag (= every TrainConfig field)

With no flags on a CPU-only machine: 8 virtual devices, strategy ``ep_as_cp`` on the mesh
``fsdp=2,expert=2,context=2`` (attention sees 4-way context parallelism, the MoE 2-way expert
parallelism), the built-in corpus (the Python standard library's sources, byte tokens), a few
minutes on 2 cores. On GPUs/TPUs it uses the real devices with FSDP. Rerunning the same
command resumes from ``runs/mini_deepseek3/checkpoints``; SIGTERM/Ctrl-C saves and exits.
"""

from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
from zoo.train import TrainConfig, cli  # importing jax starts no backend: --devices applies

# -- config -----------------------------------------------------------------------------------
MODEL = DeepSeek3Config.mini()          # --set FIELD=VALUE overrides any field
TRAIN = TrainConfig(                    # every field is a flag: --steps, --seq-len, ...
    steps=200,                          # planned total; fixes the learning-rate schedule
    batch_size=8,                       # global rows
    seq_len=256,
    lr=3e-3,                            # peak; warmup min(100, steps/10), cosine to 10%
    checkpoint_every=50,
    aux_loss_field="aux_loss_alpha",    # DeepSeek's small sequence-wise balance loss
    # aux-loss-free balancing, bias += rate*sign(mean-count) after each step. DeepSeek-V3 uses
    # 1e-3 over ~15T tokens; a 200-step run needs 1e-2 to balance visibly (measured, default
    # run: busiest expert / mean 2.38 -> 1.13 with 1e-2; 2.38 -> 3.46 with 1e-3; same loss).
    expert_bias_rate=1e-2,
)
RECIPE = cli.Recipe(name="mini_deepseek3", model_cls=DeepSeek3, config=MODEL, train=TRAIN,
                    description=__doc__.split("\n")[0])


def main(argv=None, **kwargs) -> int:
    return cli.main(RECIPE, argv, **kwargs)


if __name__ == "__main__":
    raise SystemExit(main())
