"""Model sources outside the recipe: the Hugging Face Hub and its cache on this machine (hf), and a recipe's
checkpoint, its config.json and the checks it must pass before a build starts (checkpoint).

May import: qbuild.core, qbuild.store, qbuild.model, qbuild.recipe.
"""
