"""Execute the notebooks and check (or rewrite) the outputs committed in them.

    python notebooks/run.py              # execute every notebook, compare with the committed outputs
    python notebooks/run.py --write      # execute and save the new outputs into the .ipynb files
    python notebooks/run.py quickstart   # only the notebooks whose file name contains "quickstart"

What is compared: for every code cell, its stdout text and the text/plain of its results and
displays, in order. Not compared: stderr (progress bars, log lines) and cells tagged `varies`
(set-up cells, which print pip's output on a fresh machine; timings; versions; set in the cell's
metadata "tags"). A cell that prints numbers which depend on the machine belongs in a `varies`
cell, so that the compared outputs (greedy text, seeded samples, shapes, shardings) stay exact.
Any cell's error output, or a stream containing "Warning", fails both modes.

Hazard: the compared outputs come from floating-point model runs. A different jax/XLA version
or CPU can change a greedy token where two logits nearly tie; such a drift fails the check with a
diff, and `--write` on the reference machine records the new outputs once they are reviewed.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VARIES_TAG = "varies"
TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class CellOutputs:
    """The compared outputs of one code cell."""
    index: int            # position among all cells of the notebook
    first_line: str       # the cell source's first line, to name the cell in a diff
    text: str             # stdout, then each result's text/plain, joined in output order


def notebook_paths(patterns: list[str] | None = None) -> list[str]:
    """The notebooks next to this script, optionally only those whose name contains a pattern."""
    paths = sorted(glob.glob(os.path.join(HERE, "*.ipynb")))
    if patterns:
        paths = [p for p in paths if any(s in os.path.basename(p) for s in patterns)]
    return paths


def execute(path: str):
    """Run the notebook at `path` top to bottom in a fresh python3 kernel, with the notebook's
    folder as the working directory; returns the executed nbformat node (the file is untouched).
    A failing cell raises nbclient's CellExecutionError, which names the cell and its traceback."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}}).execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = coalesce_streams(cell.outputs)
    return nb


def _settle(text: str) -> str:
    """What a terminal shows of `text`: on each line, only what follows its last carriage return
    (progress bars redraw themselves with '\\r')."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def coalesce_streams(outputs: list) -> list:
    """Consecutive stream outputs of one name merged into one, carriage returns settled, blank
    stderr dropped: a streamed token or a progress-bar redraw is otherwise one output each."""
    out = []
    for o in outputs:
        if o.get("output_type") == "stream" and out and out[-1].get("output_type") == "stream" \
                and out[-1].get("name") == o.get("name"):
            out[-1]["text"] += o.get("text", "")
        else:
            out.append(o)
    for o in out:
        if o.get("output_type") == "stream":
            o["text"] = _settle(o["text"])
    return [o for o in out if not (o.get("output_type") == "stream" and o.get("name") == "stderr"
                                   and not o["text"].strip())]


def _output_text(out) -> str:
    kind = out.get("output_type")
    if kind == "stream":
        return out.get("text", "") if out.get("name") == "stdout" else ""
    if kind in ("execute_result", "display_data"):
        text = out.get("data", {}).get("text/plain", "")
        text = "".join(text) if isinstance(text, list) else text
        return text + ("\n" if text and not text.endswith("\n") else "")
    if kind == "error":
        return f"{out.get('ename')}: {out.get('evalue')}\n"
    return ""


def compared_outputs(nb) -> list[CellOutputs]:
    """The outputs the check compares (see the module docstring)."""
    rows = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or VARIES_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        text = "".join(_output_text(o) for o in cell.get("outputs", []))
        rows.append(CellOutputs(i, (cell.source.splitlines() or [""])[0], text))
    return rows


def problems(nb) -> list[str]:
    """Outputs no executed notebook may keep: errors and warnings a reader should not see."""
    found = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if o.get("output_type") == "error":
                found.append(f"cell {i}: {o.get('ename')}: {o.get('evalue')}")
            elif o.get("output_type") == "stream" and "Warning" in o.get("text", ""):
                found.append(f"cell {i} ({o.get('name')}): {o.get('text').strip()[:300]}")
    return found


def diff(committed, executed, name: str) -> str:
    """'' when the compared outputs agree; else a unified diff per differing cell."""
    old, new = compared_outputs(committed), compared_outputs(executed)
    if [c.index for c in old] != [c.index for c in new]:
        return (f"{name}: the committed notebook's code cells {[c.index for c in old]} differ from the executed "
                f"ones {[c.index for c in new]} (cells or `varies` tags changed?)")
    parts = []
    for a, b in zip(old, new):
        if a.text != b.text:
            lines = difflib.unified_diff(a.text.splitlines(keepends=True), b.text.splitlines(keepends=True),
                                         fromfile=f"{name} cell {a.index} committed",
                                         tofile=f"{name} cell {a.index} executed now")
            parts.append(f"--- cell {a.index}: {a.first_line}\n" + "".join(lines))
    return "\n".join(parts)


def write(nb, path: str) -> None:
    import nbformat

    nbformat.validate(nb)
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    import nbformat

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="run only notebooks whose file name contains one of these")
    ap.add_argument("--write", action="store_true", help="save the executed outputs into the notebooks")
    args = ap.parse_args(argv)
    paths = notebook_paths(args.names)
    if not paths:
        print(f"no notebook in {HERE} matches {args.names}", file=sys.stderr)
        return 2
    failed = False
    for path in paths:
        name = os.path.basename(path)
        print(f"executing {name} ...", flush=True)
        executed = execute(path)
        bad = problems(executed)
        if bad:
            failed = True
            print(f"{name}: outputs a reader should not see:\n  " + "\n  ".join(bad))
        if args.write:
            write(executed, path)
            print(f"{name}: outputs written")
            continue
        d = diff(nbformat.read(path, as_version=4), executed, name)
        if d:
            failed = True
            print(f"{name}: outputs drifted from the committed ones (refresh with python notebooks/run.py --write "
                  f"once the change is intended):\n{d}")
        else:
            print(f"{name}: outputs match")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
