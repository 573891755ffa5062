"""The neuron backend's weight layout: the per-rank files NxD itself writes for each port lineage (nxd.py, the shard
step's rules for the nxd-* layouts) and the zero DeltaNet checkpoint banks a prefix-caching port takes as weights
(hybrid.py, added by the package step). docs/nxd-layout.md describes both with their upstream sources.

The shard step imports nxd.py through qbuild.backends.shard_layout, so its rules key only the neuron shard steps.
"""
