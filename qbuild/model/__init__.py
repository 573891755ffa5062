"""The models themselves: the family tables and architecture (families, arch), the FP8 policies (fp8), where long
prompts are cut into prefill chunks (chunking), the weight
converters to NxDI's layout (convert/), qbuild's reference implementation of that layout (modeling/, kernels/), the
CPU runtime that runs a bundle (runtime/), and tiny random checkpoints (tinymodel).

May import: qbuild.core, qbuild.store (a runtime reads bundles). Never the recipe, hub, planning, execution or backends layers.
"""
