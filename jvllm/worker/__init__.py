"""The worker side of jvllm: everything that touches devices (programs, inputs, executors, the model runner)."""
