"""Stores: where step outputs live. A local store of content-addressed blobs and one manifest per key (local,
manifest), optionally backed by a remote one (remote, s3); which store a command uses (spec); garbage collection of
what no lockfile names (gc), build leases (lease), a backend's side cache (side_cache) and the durations of past steps
(durations). All of it is machinery around the steps: no step's key holds a module of this package.

This module imports nothing: import what you use from its modules.

May import: qbuild.core.
"""
