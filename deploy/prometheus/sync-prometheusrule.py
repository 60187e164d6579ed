"""Copy the groups of sidecar-rules.yml into the PrometheusRule (its header kept):
``python deploy/prometheus/sync-prometheusrule.py`` after editing the rule file.
tests/test_deploy.py fails while the two differ."""

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "sidecar-rules.yml"
RESOURCE = HERE.parent / "kubernetes/base/prometheusrule.yaml"


class Block(str):
    """A multi-line string, written as a YAML literal block."""


def represent_block(dumper: yaml.Dumper, data: Block) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")


def blocks(value: object) -> object:
    if isinstance(value, dict):
        return {key: blocks(item) for key, item in value.items()}
    if isinstance(value, list):
        return [blocks(item) for item in value]
    if isinstance(value, str) and "\n" in value:
        return Block(value)
    return value


def main() -> None:
    yaml.add_representer(Block, represent_block)
    groups = yaml.safe_load(RULES.read_text())["groups"]
    text = RESOURCE.read_text()
    head = text[: text.index("spec:\n")]
    body = yaml.dump({"groups": blocks(groups)}, sort_keys=False, width=1000)
    body = "\n".join("  " + line if line else line for line in body.splitlines())
    RESOURCE.write_text(head + "spec:\n" + body + "\n")
    assert yaml.safe_load(RESOURCE.read_text())["spec"]["groups"] == groups
    print(f"wrote {RESOURCE}")


if __name__ == "__main__":
    main()
