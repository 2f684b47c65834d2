"""The CLI's modules: one a command, and no command imports another command's module."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parent.parent / "dsa_train" / "cli"
SHARED = {"_errors", "_output", "_launch", "_imports", "app", "__init__", "__main__"}


def test_no_command_module_imports_another():
    commands = {p.stem for p in CLI.glob("*.py")} - SHARED
    assert {"run", "eval", "clean", "inspect_state", "tune", "import_data"} <= commands
    leaning = []
    for path in CLI.glob("*.py"):
        if path.stem in ("app", "__init__", "__main__"):
            continue  # app registers every command
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [alias.name for alias in node.names]
                leaning += [f"{path.stem} -> {name}" for name in names if name in commands]
    assert leaning == []
