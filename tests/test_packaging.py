"""pyproject's explicit package list covers every package folder: a folder missing from it is left
out of a non-editable install (wheels, `pip install .`, the device A/B builds) while an editable
checkout still imports it, so nothing else would notice."""
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_folder_is_listed():
    cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in cfg["package-dir"].items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, base)
                found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert found - listed == set(), f"package folders missing from pyproject's packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages without a folder: {sorted(listed - found)}"


def test_installed_names_only():
    """The package code imports its mapped folders by their installed names (`jvllm.converters`,
    `jvllm.sharding`): `converters` and `sharding` are importable only from the repository root
    (the tests' working directory), so such an import passes every test and fails for users (it did:
    `update_weights` with HF pairs, the checkpoint-head check)."""
    import re

    cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    tops = sorted({folder for name, folder in cfg["package-dir"].items() if folder != name})
    rx = re.compile(rf"^\s*(from|import)\s+({'|'.join(tops)})\b", re.M)
    bad = []
    for folder in sorted(set(cfg["package-dir"].values())):
        for dirpath, _, filenames in os.walk(os.path.join(ROOT, folder)):
            for f in filenames:
                if f.endswith(".py"):
                    p = os.path.join(dirpath, f)
                    bad += [f"{os.path.relpath(p, ROOT)}: {m.group(0).strip()}" for m in rx.finditer(open(p).read())]
    assert tops and not bad, bad
