"""The ground floor every process shares, importing no engine (no torch) and nothing else of the project's: log
setup, the errors a request can run into and their HTTP shape, the names on the wire between a gateway and its
replicas, and the HTTP guards both serve behind. The gateway, the pool and the replicas build on it."""
