"""Drop-ins with serving engines' raw-op signatures: ``compat.vllm``."""
