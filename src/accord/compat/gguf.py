"""gguf's tensor-name map, built once per model layout while transformers converts a GGUF file
(models.build.convert_gguf).

transformers asks gguf for the architecture's name map once per submodule (about 400 times
for SmolLM2-135M, a fifth of the conversion's CPU time), importing `get_tensor_name_map` from
gguf inside the function that needs it, so a cached version put on the gguf module for the
duration is the one it calls. The map depends only on (architecture, layers) and is only read.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from accord.compat import incompatible, installed_version

WRITTEN_FOR = "0.19 (with transformers 5.24)"


@contextlib.contextmanager
def one_name_map_per_layout() -> Iterator[None]:
    import gguf

    build = getattr(gguf, "get_tensor_name_map", None)
    if build is None:
        raise incompatible(
            "gguf",
            installed_version("gguf"),
            "no gguf.get_tensor_name_map",
            "accord's GGUF conversion",
            WRITTEN_FOR,
        )
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build
