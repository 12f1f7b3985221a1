"""The fast paths of a step, each held to the eager model: the C decoder layers on the CPU, CUDA graphs on a GPU.
Imports model and the rooms below it."""
