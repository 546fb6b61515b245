"""Train a mini DeepSeek-V3 on the built-in corpus (placeholder until the trainer lands)."""

if __name__ == "__main__":
    print("recipes/mini_deepseek3.py: the trainer is not in this checkout yet; this will train a "
          "mini DeepSeek-V3 (MLA + sigmoid-routed MoE) with ep_as_cp on fsdp=2,expert=2,context=2 "
          "over 8 virtual CPU devices.")
