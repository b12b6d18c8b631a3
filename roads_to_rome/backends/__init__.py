"""Backends: one causal LM each, behind the contract in `base` (torch, llama.cpp, a remote server).

The names below import no torch, so the command line can offer them before loading anything."""

BACKENDS = ("torch", "llamacpp")  # the local ones; a remote LLM is named by its address
AUTO = "auto"  # llama.cpp on a CPU for GGUF files when it is installed, else torch (models/loading.py)
