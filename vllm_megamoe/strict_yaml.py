"""YAML for the project's configuration files: PyYAML's safe loader, but a mapping that names one
key twice is refused (the plain loader keeps the last value, so a repeated setting would override
the first without a word)."""
from typing import IO, Union


def load_strict_yaml(stream: Union[str, IO]):
    """yaml.safe_load that raises yaml.constructor.ConstructorError on a duplicate mapping key,
    naming the key and both lines."""
    import yaml

    class _StrictLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges; a key written beside it overrides
                continue
            key = loader.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"key {key!r} appears twice (first on line {first.start_mark.line + 1})",
                    key_node.start_mark)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    _StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return yaml.load(stream, Loader=_StrictLoader)


def read_yaml_file(path: str, label: str):
    """load_strict_yaml of the file at `path`; a ValueError starting with `label` (which names
    the setting or file) when the file cannot be read or is not valid YAML."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            return load_strict_yaml(f)
    except OSError as e:
        raise ValueError(f"{label}: cannot read the file ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{label}: not valid YAML ({e})") from e
