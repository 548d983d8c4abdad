"""The engine's commands (``stepdoctor analyze``, ``check``, ``trim``); the agent's command table maps
each to its ``main``.
"""
