from jvllm.bench.cli import main

main()
