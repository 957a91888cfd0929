"""The built-in replay stages: importing this module registers all of them.

The runner imports it; nothing it lists imports the runner or this module, so
the set is assembled without an import cycle. A new stage module is added here.
"""

from __future__ import annotations

import trajstore.replay.stages
import trajstore.router.stage

#: the modules whose import registers a built-in stage
STAGE_MODULES = (trajstore.replay.stages, trajstore.router.stage)
