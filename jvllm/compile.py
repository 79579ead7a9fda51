"""Former home of the compile bookkeeping, kept importable: see `jvllm.compilation`."""
from jvllm.compilation import (compile_count, enable_persistent_cache, executable_cache_stats,  # noqa: F401
                               install_counter, program_report, temp_bytes)
