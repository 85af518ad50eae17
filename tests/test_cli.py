"""The `harness` command line: fast help, the smoke run, and the tools schema command."""

from __future__ import annotations

import json
import subprocess
import sys

from harness.cli import main


def test_help_parses_without_importing_heavy_modules():
    code = (
        "import sys\n"
        "from harness.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'docker', 'openai', 'datasets') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: harness" in out
    assert "HEAVY []" in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("agent-harness ")


def test_smoke_run_passes_its_checks(capsys):
    assert main(["smoke", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "tool call: calculator(expression='17 * 23') -> ok: 391" in out
    assert "FAILED" not in out


def test_tools_schema_prints_schemas_and_reports_bad_targets(capsys):
    assert main(["tools", "schema", "tools.calculator:calculator"]) == 0
    (schema,) = json.loads(capsys.readouterr().out)
    assert schema["function"]["name"] == "calculator"
    assert main(["tools", "schema", "tools.executor:truncate"]) == 1
    assert "parameter 'text' is not described in the docstring" in capsys.readouterr().err
    assert main(["tools", "schema", "no_colon"]) == 2
