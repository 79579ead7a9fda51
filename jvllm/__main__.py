"""`python -m jvllm ...` is the `jvllm` command (the Makefile uses it: no reliance on PATH)."""
from jvllm.cli import main

main()
