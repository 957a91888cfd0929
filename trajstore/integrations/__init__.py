"""Integrations with training frameworks (optional extras; docs/integrations.md).

One conversion layer (`trajstore.integrations.adapter`: the `FrameworkAdapter` base,
padded-to-per-sample packing, ids, config capture, routes) under one thin adapter per
framework (``trl``, ``verl/``, ``slime/``, ``engines``, ``hf_moe``). Each imports its
framework lazily and only when used, so `import trajstore` never pulls in TRL, verl or
transformers.
"""
