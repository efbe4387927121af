"""What an engine is built from: the recipe's engine and optim sections and the row length.

Made once per run from the Recipe (EngineSpec.of, in accord.run.assemble) and handed to
build_engine, the strategy factories and the engines, so no engine holds the whole Recipe:
what one reads is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from accord.recipe.schema import EngineConfig, OptimConfig

if TYPE_CHECKING:
    from accord.recipe.schema import Recipe


@dataclass(frozen=True)
class EngineSpec:
    engine: EngineConfig  # strategy, precision, the model-parallel degrees, memory levers, compile
    optim: OptimConfig  # AdamW settings, schedule, clipping
    max_length: int  # data.max_length: the longest row (engine.tiled_mlp sizes its tiles from it)

    @classmethod
    def of(cls, recipe: Recipe) -> EngineSpec:
        return cls(recipe.engine, recipe.optim, recipe.data.max_length)
