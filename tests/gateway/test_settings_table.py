"""docs/settings.md is the table generated from the typed configs, row for row."""

from __future__ import annotations

from prefixgate.gateway import cli, settings_table


def test_the_docs_table_is_the_generated_one():
    assert settings_table.DOC.read_text(encoding="utf-8") == settings_table.render(), (
        "docs/settings.md is stale: run python -m prefixgate.gateway.settings_table")


def test_every_flag_has_its_row():
    text = settings_table.render()
    for command in cli.COMMANDS:
        for knob in cli.command_knobs(command):
            assert f"| `{knob.spec.flag}`" in text and f"`{knob.spec.env}`" in text


def test_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(settings_table, "DOC", tmp_path / "settings.md")
    assert settings_table.main([]) == 0  # writes it
    assert settings_table.main(["--check"]) == 0
    (tmp_path / "settings.md").write_text("# Settings\n")
    assert settings_table.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
