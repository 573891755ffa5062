"""Recipes -> a plan: the DAG of steps with their typed params (plan), the content keys of its nodes (keys),
and the one view of this machine that planning reads (environment). Pure over its inputs; nothing here builds.

May import: qbuild.core, qbuild.store, qbuild.model, qbuild.recipe, qbuild.hub, qbuild.backends.
"""
