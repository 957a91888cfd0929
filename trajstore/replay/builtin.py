"""The built-in replay stages: importing this module registers all of them.

The runner imports it; nothing it lists imports the runner or this module, so
the set is assembled without an import cycle. A new stage module is added here.
"""

from __future__ import annotations

import trajstore.replay.losses
import trajstore.replay.slime_math
import trajstore.replay.stages
import trajstore.replay.verl_math
import trajstore.router.stage

#: the modules whose import registers a built-in stage (or a config-selected variant of one)
STAGE_MODULES = (
    trajstore.replay.stages,
    trajstore.replay.losses,
    trajstore.replay.slime_math,
    trajstore.replay.verl_math,
    trajstore.router.stage,
)
