"""Drop-ins with serving engines' raw-op signatures: ``compat.vllm``, ``compat.sglang``."""
