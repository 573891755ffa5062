"""Running a plan: the engine that schedules nodes (engine), one node's build in a worker (job), the executors
that run jobs (executors/: a local process pool, a Ray cluster), where the source checkpoint's files are on the
worker's machine (source_files), the workspace that ties recipes, store, plan and lock together for one command
(workspace), moving locked artifacts between stores: publish and pull (transfer), and the record of the last build
beside a lockfile (record). The step kinds themselves are qbuild.steps'; none of this package is in any key.

May import: every layer below the CLI.
"""
