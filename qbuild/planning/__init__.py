"""Recipes -> a plan: the DAG of steps with their typed params (plan), the content keys of its nodes (keys), what
planning asks of a backend and what a backend adds to a plan (steps), the one view of this machine that planning
reads (environment), and the lockfile: its typed model, its verdicts on a plan, merging and writing it (lock), and
whether a locked recipe's file changed since (drift). Nothing here builds.

May import: qbuild.core, qbuild.store, qbuild.model, qbuild.recipe, qbuild.hub. Never qbuild.backends: whoever plans
passes the backends in (steps.Backends), and the backends implement planning's protocols.
"""
