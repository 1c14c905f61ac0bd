"""The README's Python blocks run as written, in order, in one namespace."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.cpu_only  # the README shows the CPU's printed tensors
def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md block {i}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "[tensor(1.), tensor(1.)]" in out and "[tensor(3.), tensor(1.)]" in out
    assert "tensor(1.)" in out


def test_readme_has_the_two_commands_first():
    text = README.read_text()
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert "make demo" in first_block and "make test" in first_block
