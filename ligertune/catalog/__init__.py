"""The catalog: the names and specifications of everything a recipe can choose, torch-free, at the
bottom of the layers (docs/architecture.md).

    kernels        the Triton kernels (recipe keys, what each replaces)
    families       which Hugging Face classes each model family uses
    architectures  the shipped random-init configs
    formats        the data formats
    objectives/    the training objectives: one module each (options, data, rules, memory, metrics)
    strategies/    the parallel strategies: one module each (options, support, rules, checkpoints, memory)
    section        the strict pydantic base every recipe section and every options model shares
    shape          `ModelShape`, the sizes behind the memory plan and the FLOPs count
    rules          `Rule`, one named check between recipe keys

The recipe schema (`ligertune.config`) is built from it; the implementations (`ligertune.patching`,
`ligertune.objectives`, `ligertune.distributed`) name the entries they implement. Nothing here
imports torch or transformers, so reading and validating a recipe stays instant.
"""
