"""Every notebook runs top to bottom on the CPU (what a Colab/Jupyter user does first), shows no
error or warning, and still prints the outputs committed in it (notebooks/run.py compares them;
`python notebooks/run.py --write` refreshes them after an intended change)."""
import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("notebooks_run", os.path.join(HERE, "..", "notebooks", "run.py"))
nbrun = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = nbrun  # dataclasses look their module up there
_spec.loader.exec_module(nbrun)

NOTEBOOKS = nbrun.notebook_paths()


def test_both_notebooks_found():
    """An empty glob would parametrize the checks below away silently."""
    assert {"quickstart.ipynb", "sharding.ipynb"} <= {os.path.basename(p) for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_committed_notebook_has_outputs(path):
    """Outputs are saved (a reader on the web sees results) and the first code cell installs."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "importlib.util.find_spec(\"jvllm\") is None" in code[0].source and "%pip install" in code[0].source
    printing = [c for c in nbrun.compared_outputs(nb)
                if "print(" in nb.cells[c.index].source or "visualize" in nb.cells[c.index].source]
    assert printing, f"{path}: no compared cell prints anything"
    empty = [c.first_line for c in printing if not c.text]
    assert not empty, f"{path}: cells without saved outputs {empty}: run python notebooks/run.py --write"
    assert not nbrun.problems(nb)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs_and_matches_committed_outputs(path):
    import nbformat

    executed = nbrun.execute(path)
    assert not nbrun.problems(executed)
    d = nbrun.diff(nbformat.read(path, as_version=4), executed, os.path.basename(path))
    assert not d, ("outputs drifted from the committed ones (if intended, refresh them with "
                   "python notebooks/run.py --write):\n" + d)


def test_diff_names_the_drifting_cell():
    """The check itself: a changed stdout fails with the cell and both texts; stderr and `varies`
    cells are ignored."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    def nb(text, err, timing):
        cells = [new_code_cell("print(greedy)", outputs=[new_output("stream", name="stdout", text=text),
                                                          new_output("stream", name="stderr", text=err)]),
                 new_code_cell("print(t)", metadata={"tags": ["varies"]},
                               outputs=[new_output("stream", name="stdout", text=timing)]),
                 new_code_cell("x", outputs=[new_output("execute_result", data={"text/plain": "(2, 3)"},
                                                        execution_count=1)])]
        return nbformat.from_dict(new_notebook(cells=cells))

    assert nbrun.diff(nb("a b\n", "bar 1/2", "1.0 s"), nb("a b\n", "bar 2/2", "9.9 s"), "t.ipynb") == ""
    d = nbrun.diff(nb("a b\n", "", ""), nb("a c\n", "", ""), "t.ipynb")
    assert "cell 0: print(greedy)" in d and "-a b" in d and "+a c" in d
    assert nbrun.problems(nb("", "TqdmWarning: IProgress not found", "")) != []


def test_streams_coalesced_as_a_terminal_shows_them():
    from nbformat.v4 import new_output

    outs = [new_output("stream", name="stdout", text=" they"), new_output("stream", name="stdout", text=" have\n"),
            new_output("stream", name="stderr", text="\rbar 1/2"), new_output("stream", name="stderr", text="\rbar 2/2\n"),
            new_output("stream", name="stderr", text="\r      \r")]
    got = nbrun.coalesce_streams(outs)
    assert [(o["name"], o["text"]) for o in got] == [("stdout", " they have\n"), ("stderr", "bar 2/2\n")]
    assert nbrun.coalesce_streams([new_output("stream", name="stderr", text="\r   \r\n")]) == []
