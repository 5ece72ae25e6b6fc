"""The ``snapstore`` command: parser, commands, rendering, and the llama.cpp commands.

Internal: the public API is what :mod:`snapstore` exports."""
