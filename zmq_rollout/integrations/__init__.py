"""Drop-in pieces for RL frameworks: ``zmq_rollout.integrations.trl`` (TRL's ``VLLMClient``).

Each module imports its framework only when used, so importing this package costs nothing.
"""
