"""Writes plumbing/trl116_defaults.json: every field a `trl rloo` command or recipe can set in TRL 1.16 (RLOOConfig
with the transformers TrainingArguments it extends, ModelConfig, the script's RLOOScriptArguments and
DatasetMixtureConfig), with its default, read from TRL's own dataclasses, and GRPOConfig's fields that RLOOConfig
lacks (grpo_only). plumbing.cli reads the table: a TRL flag given at TRL's default asks for nothing the user chose; a
GRPO-only flag is named as GRPO's.

    PYTHONPATH=benchmark/.trl116-site python benchmark/trl116_defaults.py            # rewrites the table
    PYTHONPATH=benchmark/.trl116-site python benchmark/trl116_defaults.py --check    # exit status 1 if it differs

(`make bench-env` installs TRL 1.16 in benchmark/.trl116-site.)
"""

import dataclasses
import enum
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmark/trl116_defaults.py` adds benchmark/
import plumbing  # noqa: E402

TABLE = Path(__file__).resolve().parents[1] / "plumbing" / "trl116_defaults.json"


def default_of(field: dataclasses.Field):
    """A field's default as JSON holds it: an enum by its value, a factory's product."""
    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    return value.value if isinstance(value, enum.Enum) else value


def render() -> str:
    import transformers
    import trl
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, RLOOConfig
    from trl.scripts.rloo import RLOOScriptArguments

    classes = (RLOOConfig, ModelConfig, RLOOScriptArguments, DatasetMixtureConfig)  # the `trl rloo` parser's
    rloo = {f.name for f in dataclasses.fields(RLOOConfig)}
    table = {"trl": trl.__version__, "transformers": transformers.__version__,
             "fields": {cls.__name__: {f.name: default_of(f) for f in dataclasses.fields(cls) if f.init}
                        for cls in classes},
             "grpo_only": sorted(f.name for f in dataclasses.fields(GRPOConfig) if f.init and f.name not in rloo)}
    return json.dumps(table, indent=1) + "\n"


def main(check: bool = False) -> None:
    """Writes the table from the TRL on PYTHONPATH.

    Args:
        check: write nothing; exit status 1 where the committed table is not what this TRL gives.
    """
    text = render()
    fields = sum(len(f) for f in json.loads(text)["fields"].values())
    plumbing.write_generated(TABLE, text, check, f"wrote {TABLE}: {fields} fields")


if __name__ == "__main__":
    plumbing.run_tool("trl116_defaults.py", main)
