"""What a user asks for: the recipe schema (schema), its checks against the architecture (checks), and the
typed params of each build step (params). Where its model's files are, and their checks, is qbuild.hub's.

May import: qbuild.core, qbuild.store, qbuild.model.
"""
