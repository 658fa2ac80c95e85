"""The options' ``TypedDict`` classes are generated from their one declaration
(trec_pipelines/assembly/options.py): the checked-in module is what the generator
writes, and what it holds agrees with the fields and the table."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from trec_pipelines.assembly import option_types, option_types_gen, options as opts


def test_the_checked_in_module_is_what_the_generator_writes() -> None:
    written = Path(option_types.__file__).read_text()
    assert written == option_types_gen.render(), (
        f"trec_pipelines/assembly/option_types.py is stale: run `{option_types_gen.COMMAND}`"
    )


def test_each_typed_dict_holds_the_options_of_the_concerns_it_gathers() -> None:
    hints = typing.get_type_hints(opts.PipelineOptions)
    assert list(option_types.__all__) == list(opts.OPTION_DICTS)
    for name, entry in opts.OPTION_DICTS.items():
        typed_dict = getattr(option_types, name)
        assert getattr(opts, name) is typed_dict  # re-exported by options.py
        expected = {
            f.name: hints[f.name]
            for f in dataclasses.fields(opts.PipelineOptions)
            if f.metadata["concern"] in entry.concerns
        }
        assert typing.get_type_hints(typed_dict) == expected, name
        assert typed_dict.__required_keys__ == frozenset(), name
        assert typed_dict.__doc__ == entry.doc


def test_every_option_has_a_concern_some_typed_dict_gathers() -> None:
    gathered = {c for entry in opts.OPTION_DICTS.values() for c in entry.concerns}
    for option in dataclasses.fields(opts.PipelineOptions):
        assert option.metadata["concern"] in gathered, option.name


def test_a_stale_module_fails_the_check_naming_the_command(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    stale = tmp_path / "option_types.py"
    stale.write_text(option_types_gen.render().replace("agree_ahead: bool\n", "", 1))
    monkeypatch.setattr(option_types_gen, "TARGET", stale)
    assert option_types_gen.main(["--check"]) == 1
    assert option_types_gen.COMMAND in capsys.readouterr().out
    assert option_types_gen.main([]) == 0  # writes it
    assert stale.read_text() == option_types_gen.render()
    assert option_types_gen.main(["--check"]) == 0


def test_an_option_type_defined_in_options_py_itself_is_refused(monkeypatch: Any) -> None:
    # The generated module imports each annotation's names from where options.py does;
    # a name options.py defines itself would make the two modules import each other.
    monkeypatch.setattr(option_types_gen, "_names", lambda annotation: {"PipelineOptions"})
    with pytest.raises(ValueError, match="PipelineOptions.*option_types_gen"):
        option_types_gen.render()
