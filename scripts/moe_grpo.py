#!/usr/bin/env python3
"""Tiny real MoE GRPO run on the CPU, captured into a trajstore store.

    python scripts/moe_grpo.py --store /tmp/moe.store --mode both --steps 20 --seed 0
    trajstore router compare --store /tmp/moe.store --run baseline --run r3 --plot docs/router_compare.png

See trajstore/router/moe_toy.py and docs/router.md.
"""

import sys

from trajstore.router.moe_toy import main

if __name__ == "__main__":
    sys.exit(main())
