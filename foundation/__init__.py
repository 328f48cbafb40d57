"""The ground floor every process shares and that imports no engine (no torch): today the log setup. The gateway,
the pool and the replicas build on it; it builds on nothing of the project's."""
