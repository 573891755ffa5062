"""What a user asks for: the recipe schema (schema), its checks against the architecture (checks), the model
sources it names (source), and the typed params of each build step (params).

May import: qbuild.core, qbuild.store, qbuild.model.
"""
