"""What a user asks for: the recipe schema (schema), its checks against the architecture (checks), the
typed params of each build step (params), and the recipes a lockfile holds, loaded from the files it records
(locked). Where its model's files are, and their checks, is qbuild.hub's.

May import: qbuild.core, qbuild.store, qbuild.model.
"""
