"""Compilation: the program registry (`registry`), the compile counter and persistent cache
(`counter`), jvllm's executable cache (`executable_cache`) and its traceless keys (`fingerprint`)."""
from jvllm.compilation.counter import (compile_count, disable_persistent_cache, enable_persistent_cache,  # noqa: F401
                                       install_counter, program_report, temp_bytes)
from jvllm.compilation.executable_cache import stats as executable_cache_stats  # noqa: F401
from jvllm.compilation.registry import (Programs, ProgramKind, Signature, WarmUp, lowering_count,  # noqa: F401
                                        register)
