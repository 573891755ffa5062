"""Executors run jobs: a local process pool here, a Ray cluster in qbuild.execution.executors.ray."""
