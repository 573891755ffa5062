"""The step kinds a build is made of, one module each, and their registry.

    fetch        a model source -> its snapshot (files and digests; a Hub model downloaded at its pinned commit)
    convert      the snapshot -> a description of its NxDI-layout text weights, the vision weights, config, tokenizer
    materialize  the converted text weights written out in full (only for --keep-intermediates; never locked)
    port         a backend's port source (NxDI contrib code), copied into the store
    shard        the description, streamed through the checkpoint -> per-rank weight files in the backend's layout
    compile      one of the recipe's graphs, by its backend
    package      shards, graphs and configs -> one deployable bundle
    reference    HF transformers' logits and greedy tokens for the golden prompts
    verify       the bundle against the reference: the build's accuracy gate

The registry is qbuild.steps.registry.STEPS: a list of the Step classes (qbuild.planning.step), in the order a
recipe's steps are planned; whoever plans (the workspace, a command) hands it to the planner. A step kind is one module
here and one line in STEPS. This package's own module imports nothing: a step's key holds its module's import closure,
packages' own modules included, so one that imported every step would put every step's code in every key.

May import: every layer below qbuild.execution (a step runs model, hub, store and backend code). Nothing here is
machinery: a step's key holds the import closure of its module, so a step imports only what it runs.
"""
