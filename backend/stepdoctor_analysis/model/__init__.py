"""The typed columnar trace (``trace.RankTrace``) and the arithmetic every analyzer shares: interval sets, step
windows, which events are collectives. Imports nothing else of the engine.
"""
