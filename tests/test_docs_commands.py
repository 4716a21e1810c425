"""The documented commands are true: every `python -m launch.X` / `python -m benchmarks.X` written
in README.md, WORKSPACE.md and docs/ names a module that exists and only flags that module
defines, every `--config.a.b=v` names a key of the config it runs, and the documented
`python -c` one-liners run.

Flags are read from the modules' source (the literal names given to absl's `DEFINE_*`, the flag
helpers of launch/common.py they call, and argparse's `add_argument`), so this test imports no
entry point; tests/test_launch_cli.py starts each one."""

import ast
import os
import re
import subprocess
import sys

import pytest

from launch.common import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "WORKSPACE.md", "docs/contracts.md", "docs/operations.md", "docs/architecture.md"] + sorted(
    f"docs/experiments/{f}" for f in os.listdir(os.path.join(REPO, "docs", "experiments")) if f.endswith(".md"))

# `python -m launch.train --flag=... \` up to the end of the code span, table cell (`\|` is a pipe
# inside one) or shell line.
COMMAND = re.compile(r"python -m ((?:launch|benchmarks)\.[a-z0-9_]+)((?:\\\||\\\n|[^`|\n])*)")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z_][\w.]*)")


def documented_commands() -> list[tuple[str, str, str]]:
    """(doc file, module, argument text) for every documented command."""
    found = []
    for doc in DOCS:
        text = open(os.path.join(REPO, doc), encoding="utf-8").read()
        for m in COMMAND.finditer(text):
            found.append((doc, m.group(1), m.group(2)))
    return found


def _literal_flag_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        if func.startswith("DEFINE_"):
            names.add(first.value)
        elif func == "add_argument" and first.value.startswith("--"):
            names.add(first.value[2:].replace("-", "_"))
    return names


def _common_helpers() -> dict[str, set[str]]:
    """launch/common.py's flag helpers: function name -> the flags it defines."""
    tree = ast.parse(open(os.path.join(REPO, "launch", "common.py"), encoding="utf-8").read())
    return {f.name: _literal_flag_names(f) for f in tree.body if isinstance(f, ast.FunctionDef)}


def defined_flags(module: str) -> set[str]:
    tree = ast.parse(open(os.path.join(REPO, *module.split(".")) + ".py", encoding="utf-8").read())
    names = _literal_flag_names(tree)
    helpers = _common_helpers()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
            names |= helpers[node.func.id]
    return names | {"helpshort", "helpfull", "help"}


def _config_path(module: str, args: str) -> str:
    given = re.search(r"--config=(\S+?\.py)", args)
    if given:
        return given.group(1)
    return "configs/rm_tiny.py" if module in ("launch.rm_build", "launch.rm_train") else "configs/tiny.py"


def _has_key(cfg, dotted: str) -> bool:
    node = cfg
    for part in dotted.split("."):
        if not hasattr(node, "keys") or part not in node.keys():
            return False
        node = node[part]
    return True


def test_docs_document_commands():
    commands = documented_commands()
    modules = {m for _, m, _ in commands}
    assert {"launch.train", "launch.serve", "launch.score", "launch.label", "launch.build_data"} <= modules
    assert len(commands) >= 40, len(commands)


@pytest.mark.parametrize("doc, module, args", documented_commands(),
                         ids=lambda v: v if isinstance(v, str) and "\n" not in v and len(v) < 40 else "")
def test_documented_command_is_true(doc, module, args):
    path = os.path.join(REPO, *module.split(".")) + ".py"
    assert os.path.isfile(path), f"{doc}: python -m {module}: no such module"
    flags = defined_flags(module)
    configs = {}
    for name in FLAG.findall(args):
        if name.startswith("config."):
            cfg_file = _config_path(module, args)
            assert "config" in flags, f"{doc}: {module} takes no --config"
            if cfg_file not in configs:
                configs[cfg_file] = load_config(os.path.join(REPO, cfg_file))
            assert _has_key(configs[cfg_file], name[len("config."):]), f"{doc}: {module} --{name}: not a key of {cfg_file}"
            continue
        bool_form = name[2:] if name.startswith("no") else None
        assert name in flags or bool_form in flags, (
            f"{doc}: python -m {module} --{name}: {module} defines no such flag (it has {sorted(flags)})")


def documented_one_liners() -> list[tuple[str, str]]:
    """(doc file, code) for every `python -c "..."` line of the docs."""
    found = []
    for doc in DOCS:
        for line in open(os.path.join(REPO, doc), encoding="utf-8").read().splitlines():
            m = re.fullmatch(r'\s*python -c "(.*)"', line)
            if m:
                found.append((doc, m.group(1)))
    return found


def test_one_liners_run():
    """The documented one-liners run; the registry lists the architectures, describe() the keys."""
    outputs = {}
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for doc, code in documented_one_liners():
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{doc}: python -c {code!r}\n{proc.stderr[-2000:]}"
        outputs[code] = proc.stdout
    registry = next(out for code, out in outputs.items() if "known_model_types" in code)
    assert {"qwen3_vl_moe", "qwen3_5_moe", "qwen3_5_moe_text"} <= set(re.findall(r"'(\w+)'", registry)), registry
    described = next(out for code, out in outputs.items() if "describe()" in code)
    assert re.search(r"^train\.steps = ", described, re.M) and re.search(r"^mesh\.fsdp = ", described, re.M), described


def test_contracts_name_every_entry_point_and_flag():
    """docs/contracts.md is complete: every launch module, and every flag it defines."""
    text = open(os.path.join(REPO, "docs", "contracts.md"), encoding="utf-8").read()
    for f in sorted(os.listdir(os.path.join(REPO, "launch"))):
        if not f.endswith(".py") or f in ("__init__.py", "common.py"):
            continue
        module = f"launch.{f[:-3]}"
        assert f"python -m {module} " in text, f"docs/contracts.md does not document {module}"
        missing = sorted(name for name in defined_flags(module) - {"help", "helpshort", "helpfull"}
                         if f"--{name}" not in text and f"--no{name}" not in text)
        assert not missing, f"docs/contracts.md: {module} flags {missing} are not documented"


def test_config_keys_in_prose_exist():
    """A config key the docs name in backticks (`train.verdict_weight`, `data.max_len=640`) is a
    key of the embedded default or of the scalar RM's config."""
    configs = [load_config(os.path.join(REPO, "configs", name)) for name in ("tiny.py", "rm_tiny.py")]
    key = re.compile(r"`(?:--config\.)?((?:data|train|mesh|moe|rm)\.[a-z_][a-z0-9_.]*[a-z0-9_])(?:=[^`]*)?`")
    for doc in DOCS:
        for name in key.findall(open(os.path.join(REPO, doc), encoding="utf-8").read()):
            assert any(_has_key(cfg, name) for cfg in configs), f"{doc}: `{name}` is not a config key"


def test_doc_links_stay_inside_the_repository():
    """Users clone the repository alone: every relative link resolves to a file in it."""
    for doc in DOCS:
        text = open(os.path.join(REPO, doc), encoding="utf-8").read()
        assert "../shared" not in text and "DESIGN" not in text, f"{doc} points outside the repository"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path = os.path.normpath(os.path.join(REPO, os.path.dirname(doc), target))
            assert path.startswith(REPO + os.sep) and os.path.exists(path), f"{doc}: broken link {target}"
