"""Integrations with training frameworks (optional extras; docs/integrations.md).

Each module imports its framework lazily and only when used, so `import trajstore` never
pulls in TRL or transformers.
"""
