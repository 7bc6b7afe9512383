"""Code shared by the example scripts (command line, distributed setup, privacy engine
wiring, training loop, checkpoints, metrics). Each example stays readable on its own; what
every private training script needs in the same way lives here once.

The example scripts put their own folder on ``sys.path`` (``python examples/<name>.py``),
so this package is imported as ``common``.
"""
