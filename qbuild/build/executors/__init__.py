"""Executors run jobs: a local process pool here, a Ray cluster in qbuild.build.executors.ray."""
