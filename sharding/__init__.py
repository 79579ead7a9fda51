"""Meshes and logical-axis rules (installed as `jvllm.sharding`). Filled in by the sharding work."""
