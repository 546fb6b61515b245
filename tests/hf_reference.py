"""Shared by the model parity tests: build, perturb, save and run a tiny transformers model."""

import types

import numpy as np
import torch
import transformers


def saved_reference(cfg, tmp_path_factory, name: str, *, batch: int, length: int,
                    bias_scale: float = 0.0) -> types.SimpleNamespace:
    """A random eager-attention model from `cfg`, saved with `save_pretrained`, and its logits.

    Norm scales are perturbed so a mixed-up norm cannot hide; ``bias_scale`` > 0 also randomises
    DeepSeek's ``e_score_correction_bias`` buffers (transformers initialises them to zero).
    """
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
        if bias_scale:
            for bname, b in model.named_buffers():
                if "e_score_correction_bias" in bname:
                    b.copy_(bias_scale * torch.randn_like(b))
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, length))
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.numpy()
    return types.SimpleNamespace(path=path, model=model, config=cfg, tokens=tokens, logits=logits)
