"""resources/config.example.toml is the configuration reference (docs/configuration.md
points to it): every key the code reads is in it, with its default value, and
it holds no key the code doesn't read. The commented [[models]] and [[peers]]
tables name every key of an entry (their values are examples, not defaults)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from tray_app.core import config

EXAMPLE = Path(__file__).resolve().parents[3] / "resources" / "config.example.toml"


def as_toml_value(value):
    """A default as TOML reads it back: tuples are arrays."""
    return list(value) if isinstance(value, tuple) else value


def test_every_section_of_the_code_is_in_the_example_and_no_other():
    assert set(tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))) == set(config._SECTIONS)


@pytest.mark.parametrize("section", sorted(config._SECTIONS))
def test_each_key_is_documented_with_its_default_and_each_documented_key_is_read(section):
    written = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))[section]
    cls = config._SECTIONS[section]
    read = {field.name for field in dataclasses.fields(cls)}
    assert sorted(read - set(written)) == [], f"[{section}] keys the code reads that the example lacks"
    assert sorted(set(written) - read) == [], f"[{section}] keys in the example that the code doesn't read"
    defaults = cls()
    wrong = {key: (value, as_toml_value(getattr(defaults, key))) for key, value in written.items()
             if value != as_toml_value(getattr(defaults, key))}
    assert wrong == {}, f"[{section}] (example, default) where they differ"
    # The example as a whole is a valid config, and changes nothing.
    assert config.parse_config_text(EXAMPLE.read_text(encoding="utf-8")) == config.Config()


def commented_table(name: str) -> dict:
    """The commented-out [[name]] table of the example, parsed."""
    text = EXAMPLE.read_text(encoding="utf-8")
    block = re.search(rf"^# \[\[{name}\]\]\n((?:# \w+ = .*\n)+)", text, re.M)
    assert block, f"no commented [[{name}]] table in the example"
    return tomllib.loads("".join(line[2:] + "\n" for line in block.group(1).splitlines()))


@pytest.mark.parametrize("name, cls", [("models", config.ModelEntry), ("peers", config.PeerEntry)])
def test_the_commented_list_tables_name_every_key_of_an_entry(name, cls):
    assert set(commented_table(name)) == {field.name for field in dataclasses.fields(cls)}
