"""The shape of the package: `zoo/train` names no family; `import zoo` reaches every
subpackage; the families are registered. (The floors and import cycles: test_floors.py.)"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = ROOT / "zoo" / "train"
FAMILY_NAMES = re.compile(r"DeepSeek3Config|MixtralConfig|Qwen3MoeConfig|GptOssConfig|"
                          r"Glm4MoeConfig|isinstance\(config, ")


def test_the_training_floor_names_no_family():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted(TRAIN.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if FAMILY_NAMES.search(line)]
    assert not hits, "\n".join(hits)


def test_import_zoo_reaches_every_subpackage():
    code = ("import zoo; "
            "mods = [zoo.layers.Attention, zoo.models.registry, zoo.data.text_dataset, "
            "zoo.ops.attention, zoo.train.Trainer, zoo.shardings]; print(len(mods))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "6", out.stderr[-2000:]


def test_every_family_is_registered_with_its_presets():
    from zoo.models import registry
    from zoo.train.rehearse import PRESETS
    assert {"deepseek3", "mixtral", "qwen3_moe"} <= set(registry.names())
    assert set(PRESETS) == set(registry.preset_names())
    for name in registry.preset_names():
        family, config = registry.resolve(name)
        assert isinstance(config, family.config_cls)
        assert registry.family_of(config) is family
    assert registry.get("deepseek3").after_step is not None  # the expert-bias update
