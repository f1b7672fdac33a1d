"""docs/ARCHITECTURE.md names only what exists: every path in backticks is in the repository, every dotted
`rlhf.`/`tests.` name imports (module, then attributes), and every other code name is defined somewhere in the
code (a def, a class, an assignment, an annotation or an attribute)."""

import importlib
import os
import re

from tests.distributed import ROOT

DOC = os.path.join(ROOT, "docs", "ARCHITECTURE.md")


def code_names() -> list[str]:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"`([^`\n]+)`", text)


def source_text() -> str:
    chunks = []
    for top in ("rlhf", "kernels", "tests"):
        for directory, _, files in os.walk(os.path.join(ROOT, top)):
            chunks += [open(os.path.join(directory, n), encoding="utf-8").read() for n in files if n.endswith(".py")]
    return "\n".join(chunks)


def resolve(dotted: str) -> object:
    """Import the longest module prefix of `dotted`, then take the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_name_in_the_architecture_doc_exists():
    source = source_text()
    missing = []
    for name in dict.fromkeys(code_names()):
        if name.startswith("-") or " " in name or name.isupper() or "SAVE_PATH" in name or "{" in name:
            continue  # flags, commands, placeholders
        if "/" in name or name.endswith((".md", ".cfg", ".sh", ".py")):
            if not os.path.exists(os.path.join(ROOT, name.rstrip("/"))):
                missing.append(name)
        elif name.startswith(("rlhf.", "tests.")):
            try:
                resolve(name)
            except (ImportError, AttributeError):
                missing.append(name)
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name) and ("_" in name or "." in name or name[0].isupper()):
            for part in name.split("."):
                if not re.search(rf"\b(def|class)\s+{part}\b|\b{part}\s*[:=]|\.{part}\b", source):
                    missing.append(name)
    assert not missing, f"docs/ARCHITECTURE.md names what the code does not have: {missing}"


def test_the_check_catches_a_stale_name(tmp_path, monkeypatch):
    stale = tmp_path / "ARCHITECTURE.md"
    stale.write_text("`rlhf/train/ppo.py`, `rlhf.core.run.NoSuchThing`, `ghost_function`")
    monkeypatch.setitem(globals(), "DOC", str(stale))
    try:
        test_every_name_in_the_architecture_doc_exists()
    except AssertionError as err:
        assert all(n in str(err) for n in ("rlhf/train/ppo.py", "rlhf.core.run.NoSuchThing", "ghost_function"))
    else:
        raise AssertionError("the stale names passed")
