"""Optional HTA analyses of a trace (critical path), queued and read through its service."""
