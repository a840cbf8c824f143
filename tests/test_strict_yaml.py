"""The configuration files' YAML loader refuses a key given twice in one mapping."""
import pytest
import yaml

from vllm_megamoe.strict_yaml import load_strict_yaml


def test_reads_what_safe_load_reads():
    text = "a: 1\nb: {c: [1, 2.5, x]}\nd: null\n"
    assert load_strict_yaml(text) == yaml.safe_load(text)
    assert load_strict_yaml("") is None


def test_a_repeated_key_is_refused_with_both_lines():
    with pytest.raises(yaml.YAMLError, match=r"(?s)'a' appears twice \(first on line 1\).*line 3"):
        load_strict_yaml("a: 1\nb: 2\na: 3\n")
    with pytest.raises(yaml.YAMLError, match="'k' appears twice"):  # nested, flow style
        load_strict_yaml("x:\n  - {k: 1, k: 2}\n")
    assert load_strict_yaml("x: {k: 1}\ny: {k: 2}\n") == {"x": {"k": 1}, "y": {"k": 2}}  # other mappings


def test_merge_keys_may_be_overridden():
    assert load_strict_yaml("base: &b {a: 1, c: 3}\nuse:\n  <<: *b\n  a: 5\n")["use"] == {"a": 5, "c": 3}


def test_read_yaml_file_names_the_file_in_its_errors(tmp_path):
    from vllm_megamoe.strict_yaml import read_yaml_file
    good = tmp_path / "good.yaml"
    good.write_text("a: 1\n")
    assert read_yaml_file(str(good), "LABEL") == {"a": 1}
    with pytest.raises(ValueError, match=r"^LABEL: cannot read the file \("):
        read_yaml_file(str(tmp_path), "LABEL")  # a directory
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\na: 2\n")
    with pytest.raises(ValueError, match=r"(?s)^LABEL: not valid YAML .*'a' appears twice"):
        read_yaml_file(str(bad), "LABEL")
